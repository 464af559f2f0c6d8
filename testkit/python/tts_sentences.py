"""Sentences for speaking tests and the text to speech benchmark (tests/python/test_speech.py,
bench/tts.py): ordinary English of 4 to 22 words, with punctuation, a question, an exclamation
and a clause break, so sentence splitting and Piper's punctuation handling are exercised."""

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "Please call Stella and ask her to bring these things with her from the store.",
    "She sells sea shells by the sea shore, and he laughed.",
    "Kubernetes schedules the model servers onto the nodes with graphics cards.",
    "It is a truth universally acknowledged that a single man in possession of a good fortune must be in want of a wife.",
    "The meeting starts at nine.",
    "Can you hear me now?",
    "Every replica of the model answers requests from the same endpoint, whichever node it runs on.",
    "Thank you, and goodbye.",
]
