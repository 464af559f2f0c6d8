//! Untrusted-input parsers (before engine selection and loading): GGUF headers, Hugging Face
//! `config.json`, ONNX model configs and engine plugin manifests.
//!
//! Everything here reads bytes that came from a download, a volume or a
//! plugin image, so every parser bounds its input size, checks each declared
//! length against the bytes actually present, and returns an error — never a
//! panic — on hostile input. The crate stays free of heavy dependencies so
//! the fuzz targets in `fuzz/` can build it with sanitizers in seconds.
#![forbid(unsafe_code)]

pub mod gguf;
pub mod hf_config;
pub mod manifest;
pub mod onnx;
