"""Word error counting for speech recognition checks (tests/python/test_transcription.py,
bench/whisper.py): the words of a transcript, normalised, and the word-level edit distance."""
import re


def words(text: str) -> list[str]:
    """Lower case, punctuation and hyphens as spaces, "Mr." as the "mister" the LibriVox
    transcripts spell out."""
    text = text.lower().replace("mr.", "mister")
    return re.sub(r"[^a-z0-9']+", " ", text).split()


def word_errors(got: list[str], want: list[str]) -> int:
    """Substitutions, insertions and deletions turning `got` into `want`."""
    row = list(range(len(want) + 1))
    for i, g in enumerate(got):
        prev, row[0] = row[0], i + 1
        for j, w in enumerate(want):
            cur = row[j + 1]
            row[j + 1] = min(prev + (g != w), row[j] + 1, cur + 1)
            prev = cur
    return row[-1]
