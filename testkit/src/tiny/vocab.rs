//! Test support (outside the request path): the tiny model's tokenizer side, a
//! SentencePiece-style vocabulary (specials, byte fallback, whole-word pieces) with its fixed
//! token ids, and the ChatML template written next to it.

use std::collections::HashSet;

use super::TinyModelSpec;

/// `<unk>`, llama.cpp's `tokenizer.ggml.unknown_token_id`.
pub const UNK_ID: u32 = 0;
/// `<s>`, added in front of every prompt (`add_bos_token = true`).
pub const BOS_ID: u32 = 1;
/// `</s>`, end of generation.
pub const EOS_ID: u32 = 2;
/// `<|im_start|>` (control token, ChatML).
pub const IM_START_ID: u32 = 3;
/// `<|im_end|>` (control token, ChatML); also `tokenizer.ggml.eot_token_id`, so it ends generation.
pub const IM_END_ID: u32 = 4;
/// `<0x00>`; byte `b` is token `FIRST_BYTE_ID + b`.
pub const FIRST_BYTE_ID: u32 = 5;
/// First normal piece (`▁`); normal pieces run from here to the end of the vocabulary.
pub const FIRST_NORMAL_ID: u32 = FIRST_BYTE_ID + 256;

/// SentencePiece's word-boundary marker (U+2581), which stands for a space.
pub const SPACE_MARKER: char = '\u{2581}';

/// A small ChatML template (the `<|im_start|>role\ncontent<|im_end|>\n` format), which llama.cpp
/// also recognises by name.
pub const CHATML_TEMPLATE: &str = concat!(
    "{% for message in messages %}",
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
    "{% endfor %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
);

/// Words that get whole-word pieces (with the `▁` prefix, and every prefix of them so that
/// SentencePiece's pairwise merging can reach them).
const WORDS: &[&str] = &[
    "the",
    "a",
    "an",
    "is",
    "of",
    "and",
    "to",
    "in",
    "it",
    "that",
    "what",
    "What",
    "The",
    "Paris",
    "capital",
    "France",
    "Question",
    "Answer",
    "Hello",
    "hello",
    "world",
    "city",
    "country",
    "you",
    "are",
    "was",
    "for",
    "on",
    "with",
    "this",
    "one",
    "two",
    "three",
    "yes",
    "no",
    "name",
    "user",
    "assistant",
    "system",
    "model",
    "test",
];

// llama.cpp's `llama_token_type` values written to `tokenizer.ggml.token_type`.
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_BYTE: i32 = 6;
/// One vocabulary entry.
#[derive(Debug, Clone, PartialEq)]
pub struct VocabEntry {
    pub piece: String,
    pub score: f32,
    /// llama.cpp token type (1 normal, 2 unknown, 3 control, 6 byte).
    pub token_type: i32,
}

/// The vocabulary: specials (ids 0..=4), the 256 byte tokens (ids 5..=260), then normal pieces
/// starting at [`FIRST_NORMAL_ID`]. Pieces are unique (llama.cpp asserts that).
///
/// Normal pieces score their length in characters, so the SentencePiece merger prefers longer
/// pieces; specials and bytes score 0 (bytes are only a fallback).
pub fn tiny_vocab(spec: &TinyModelSpec) -> Vec<VocabEntry> {
    let mut entries = Vec::new();
    let mut push = |piece: String, score: f32, token_type: i32| {
        entries.push(VocabEntry {
            piece,
            score,
            token_type,
        });
    };
    push("<unk>".into(), 0.0, TYPE_UNKNOWN);
    push("<s>".into(), 0.0, TYPE_CONTROL);
    push("</s>".into(), 0.0, TYPE_CONTROL);
    push("<|im_start|>".into(), 0.0, TYPE_CONTROL);
    push("<|im_end|>".into(), 0.0, TYPE_CONTROL);
    for b in 0..=255u8 {
        push(format!("<0x{b:02X}>"), 0.0, TYPE_BYTE);
    }

    let mut normal: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut add = |piece: String| {
        if seen.insert(piece.clone()) {
            normal.push(piece);
        }
    };
    add(SPACE_MARKER.to_string());
    // Printable ASCII except the space (which SentencePiece turns into `▁`).
    for c in '!'..='~' {
        add(c.to_string());
    }
    for c in '!'..='~' {
        add(format!("{SPACE_MARKER}{c}"));
    }
    for word in WORDS {
        // Every prefix `▁w`, `▁wo`, ... up to the whole word: the SPM merger only joins two
        // adjacent pieces when their concatenation is itself a piece.
        let mut piece = SPACE_MARKER.to_string();
        for c in word.chars() {
            piece.push(c);
            add(piece.clone());
        }
    }
    for i in 0..spec.n_vocab_extra {
        add(format!("{SPACE_MARKER}x{i}"));
    }
    for piece in normal {
        let score = piece.chars().count() as f32;
        push(piece, score, TYPE_NORMAL);
    }
    entries
}
