//! Test support (outside the request path): writers for the tiny GGUF models that inference tests run.
//!
//! [`write_tiny_gguf`] writes a deterministic, random-weight `llama` model (about 0.6 MB, all F32)
//! with a SentencePiece-style vocabulary and a ChatML template that real llama.cpp loads and runs;
//! [`hf::write_tiny_hf`] writes tiny random-weight Hugging Face directories (safetensors) of
//! each architecture the native engine runs;
//! [`read_gguf_metadata`] reads the KV metadata of any GGUF file back as JSON values;
//! [`k8s_check`] checks rendered Kubernetes manifests against the `k8s-openapi` types;
//! [`gemma_gguf`] finds the real Gemma 3 270M GGUF the setup fetched.

pub mod gguf;
pub mod hf;
pub mod k8s_check;
pub mod tiny;

use std::path::PathBuf;

/// The real Gemma 3 270M GGUF (Q4_K_M): `GANTRY_GEMMA_GGUF`, else the setup's cache.
/// scripts/setup.sh provides it; without it a test fails with instructions rather than
/// passing silently.
pub fn gemma_gguf() -> PathBuf {
    let p = std::env::var_os("GANTRY_GEMMA_GGUF")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/gantry/models/gemma-3-270m-q4_k_m.gguf"))
        })
        .expect("HOME or GANTRY_GEMMA_GGUF");
    assert!(
        p.is_file(),
        "Gemma 3 270M not found at {}: run scripts/fetch-model.sh (scripts/test.sh does)",
        p.display()
    );
    p
}

pub use gguf::{
    GgufHeader, GgufTensorInfo, GgufValue, GgufWriter, read_gguf_header, read_gguf_metadata,
};
pub use tiny::{
    BOS_ID, CHATML_TEMPLATE, EOS_ID, FIRST_BYTE_ID, FIRST_NORMAL_ID, IM_END_ID, IM_START_ID,
    TinyModelSpec, UNK_ID, VocabEntry, tiny_gguf_writer, tiny_vocab, write_tiny_gguf,
};
