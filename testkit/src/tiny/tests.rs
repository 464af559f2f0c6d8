//! The tiny model's vocabulary, metadata and tensors, read back from the bytes it writes.

use std::collections::HashSet;

use super::*;
use crate::gguf::{read_gguf_header, read_gguf_metadata};
use serde_json::json;
use std::fs;

fn write(spec: &TinyModelSpec) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, spec).expect("write tiny gguf");
    (dir, path)
}

#[test]
fn vocabulary_layout() {
    let vocab = tiny_vocab(&TinyModelSpec::default());
    assert!(
        (400..=600).contains(&vocab.len()),
        "vocab size {}",
        vocab.len()
    );
    let piece = |id: u32| vocab[id as usize].piece.as_str();
    assert_eq!(piece(UNK_ID), "<unk>");
    assert_eq!(piece(BOS_ID), "<s>");
    assert_eq!(piece(EOS_ID), "</s>");
    assert_eq!(piece(IM_START_ID), "<|im_start|>");
    assert_eq!(piece(IM_END_ID), "<|im_end|>");
    assert_eq!(piece(FIRST_BYTE_ID), "<0x00>");
    assert_eq!(piece(FIRST_BYTE_ID + 0x0A), "<0x0A>");
    assert_eq!(piece(FIRST_NORMAL_ID - 1), "<0xFF>");
    assert_eq!(piece(FIRST_NORMAL_ID), "▁");
    assert_eq!(vocab[IM_END_ID as usize].token_type, 3);
    assert_eq!(vocab[FIRST_BYTE_ID as usize].token_type, 6);

    let unique: HashSet<&str> = vocab.iter().map(|e| e.piece.as_str()).collect();
    assert_eq!(unique.len(), vocab.len(), "pieces must be unique");
    // Whole words are reachable by pairwise merges: every prefix is a piece too.
    for p in [
        "▁P", "▁Pa", "▁Par", "▁Pari", "▁Paris", "▁the", "a", "▁a", "?",
    ] {
        assert!(unique.contains(p), "missing {p}");
    }

    let extra = tiny_vocab(&TinyModelSpec {
        n_vocab_extra: 20,
        ..TinyModelSpec::default()
    });
    assert_eq!(extra.len(), vocab.len() + 20);
}

#[test]
fn metadata_is_what_llama_cpp_reads() {
    let (_dir, path) = write(&TinyModelSpec::default());
    let m = read_gguf_metadata(&path).expect("metadata");
    let n_vocab = tiny_vocab(&TinyModelSpec::default()).len();
    assert_eq!(m["general.architecture"], json!("llama"));
    assert_eq!(m["general.name"], json!("gantry-tiny"));
    assert_eq!(m["general.file_type"], json!(0));
    assert_eq!(m["general.alignment"], json!(32));
    assert_eq!(m["llama.context_length"], json!(2048));
    assert_eq!(m["llama.embedding_length"], json!(64));
    assert_eq!(m["llama.block_count"], json!(2));
    assert_eq!(m["llama.feed_forward_length"], json!(128));
    assert_eq!(m["llama.attention.head_count"], json!(4));
    assert_eq!(m["llama.attention.head_count_kv"], json!(2));
    assert_eq!(m["llama.rope.dimension_count"], json!(16));
    assert_eq!(m["llama.vocab_size"], json!(n_vocab));
    assert!(
        m["llama.attention.layer_norm_rms_epsilon"]
            .as_f64()
            .is_some()
    );
    assert_eq!(m["llama.rope.freq_base"], json!(10000.0));
    assert!(!m.contains_key("llama.pooling_type"));
    assert_eq!(m["tokenizer.ggml.model"], json!("llama"));
    assert_eq!(
        m["tokenizer.ggml.tokens"].as_array().map(Vec::len),
        Some(n_vocab)
    );
    assert_eq!(
        m["tokenizer.ggml.scores"].as_array().map(Vec::len),
        Some(n_vocab)
    );
    assert_eq!(
        m["tokenizer.ggml.token_type"].as_array().map(Vec::len),
        Some(n_vocab)
    );
    assert_eq!(m["tokenizer.ggml.bos_token_id"], json!(BOS_ID));
    assert_eq!(m["tokenizer.ggml.eos_token_id"], json!(EOS_ID));
    assert_eq!(m["tokenizer.ggml.unknown_token_id"], json!(UNK_ID));
    assert_eq!(m["tokenizer.ggml.eot_token_id"], json!(IM_END_ID));
    assert_eq!(m["tokenizer.ggml.add_bos_token"], json!(true));
    assert_eq!(m["tokenizer.ggml.add_eos_token"], json!(false));
    assert_eq!(m["tokenizer.chat_template"], json!(CHATML_TEMPLATE));
}

#[test]
fn tensors_are_complete_aligned_and_sized() {
    let spec = TinyModelSpec::default();
    let (_dir, path) = write(&spec);
    let h = read_gguf_header(&path).expect("header");
    let n_vocab = tiny_vocab(&spec).len() as u64;
    // 3 global tensors + 9 per block.
    assert_eq!(h.tensors.len(), 3 + 9 * spec.n_layer as usize);
    assert_eq!(h.data_offset % 32, 0);
    let by_name = |n: &str| {
        h.tensors
            .iter()
            .find(|t| t.name == n)
            .unwrap_or_else(|| panic!("missing tensor {n}"))
    };
    assert_eq!(by_name("token_embd.weight").dims, vec![64, n_vocab]);
    assert_eq!(by_name("output.weight").dims, vec![64, n_vocab]);
    assert_eq!(by_name("output_norm.weight").dims, vec![64]);
    assert_eq!(by_name("blk.1.attn_q.weight").dims, vec![64, 64]);
    assert_eq!(by_name("blk.1.attn_k.weight").dims, vec![64, 32]);
    assert_eq!(by_name("blk.1.attn_v.weight").dims, vec![64, 32]);
    assert_eq!(by_name("blk.1.attn_output.weight").dims, vec![64, 64]);
    assert_eq!(by_name("blk.0.ffn_gate.weight").dims, vec![64, 128]);
    assert_eq!(by_name("blk.0.ffn_up.weight").dims, vec![64, 128]);
    assert_eq!(by_name("blk.0.ffn_down.weight").dims, vec![128, 64]);

    // Offsets are aligned and contiguous (llama.cpp requires offset == running padded size).
    let mut expected = 0u64;
    for t in &h.tensors {
        assert_eq!(t.offset % 32, 0, "{} misaligned", t.name);
        assert_eq!(t.offset, expected, "{} not contiguous", t.name);
        let bytes = t.dims.iter().product::<u64>() * 4;
        expected += bytes.div_ceil(32) * 32;
    }
    let bytes = fs::read(&path).expect("bytes");
    assert_eq!(bytes.len() as u64, h.data_offset + expected);

    // Norm weights are exactly 1.0; all weights are finite.
    let t = by_name("blk.1.ffn_norm.weight");
    let start = (h.data_offset + t.offset) as usize;
    let data = &bytes[start..start + 64 * 4];
    assert!(
        data.chunks(4)
            .all(|c| f32::from_le_bytes(c.try_into().expect("4")) == 1.0)
    );
    let all = &bytes[h.data_offset as usize..];
    assert!(
        all.chunks(4)
            .all(|c| f32::from_le_bytes(c.try_into().expect("4")).is_finite())
    );
}

#[test]
fn deterministic_per_seed() {
    let a = tiny_gguf_writer(&TinyModelSpec::default())
        .expect("a")
        .to_bytes();
    let b = tiny_gguf_writer(&TinyModelSpec::default())
        .expect("b")
        .to_bytes();
    assert_eq!(a, b);
    let (_dir, path) = write(&TinyModelSpec::default());
    assert_eq!(fs::read(&path).expect("file"), a, "file == in-memory bytes");
    let c = tiny_gguf_writer(&TinyModelSpec {
        seed: 1,
        ..TinyModelSpec::default()
    })
    .expect("c")
    .to_bytes();
    assert_eq!(a.len(), c.len());
    assert_ne!(a, c);
}

#[test]
fn variants() {
    let (_d1, emb) = write(&TinyModelSpec {
        embedding: true,
        ..TinyModelSpec::default()
    });
    let m = read_gguf_metadata(&emb).expect("metadata");
    assert_eq!(m["llama.pooling_type"], json!(1));

    let (_d2, unknown) = write(&TinyModelSpec {
        architecture_name_override: Some("unknownarch".into()),
        chat_template: None,
        context_length: 512,
        file_type: 7,
        ..TinyModelSpec::default()
    });
    let m = read_gguf_metadata(&unknown).expect("metadata");
    assert_eq!(m["general.architecture"], json!("unknownarch"));
    assert_eq!(m["unknownarch.context_length"], json!(512));
    assert_eq!(m["general.file_type"], json!(7));
    assert!(!m.contains_key("llama.context_length"));
    assert!(!m.contains_key("tokenizer.chat_template"));
}

#[test]
fn rejects_inconsistent_shapes() {
    for spec in [
        TinyModelSpec {
            n_head: 5,
            ..TinyModelSpec::default()
        },
        TinyModelSpec {
            n_head_kv: 3,
            ..TinyModelSpec::default()
        },
        TinyModelSpec {
            n_layer: 0,
            ..TinyModelSpec::default()
        },
    ] {
        assert!(tiny_gguf_writer(&spec).is_err(), "{spec:?}");
    }
}
