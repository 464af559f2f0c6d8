//! Test support: a minimal GGUF v3 writer (little-endian), with no dependency on llama.cpp, and
//! a header reader on top of the node's own parser (`gantry-formats`).
//!
//! Layout written (the order llama.cpp's `gguf_init_from_file` reads):
//! magic `GGUF`, version u32 = 3, tensor count i64, KV count i64, the KV pairs, the tensor infos,
//! zero padding up to `general.alignment`, then the tensor data. Every tensor's data starts at an
//! offset (relative to the data section) that is a multiple of the alignment, and llama.cpp insists
//! that each offset equals the sum of the padded sizes of the tensors before it, so tensors are laid
//! out back to back in the order they were added, each padded to the alignment (the last one too).

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result, ensure};
pub use gantry_formats::gguf::{GgufHeader, GgufTensorInfo};
use gantry_formats::gguf::{GgufValue as Parsed, ParseOptions, read_header_with};

/// `GGUF` as little-endian bytes.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The only version written.
pub const GGUF_VERSION: u32 = 3;
/// llama.cpp's `GGUF_DEFAULT_ALIGNMENT`; also what we write as `general.alignment`.
pub const DEFAULT_ALIGNMENT: u32 = 32;
/// `ggml_type` id of 32-bit float tensors (`GGML_TYPE_F32`).
pub const GGML_TYPE_F32: u32 = 0;

// `gguf_type` ids (ggml/include/gguf.h).
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;

/// A metadata value of one of the types this writer emits.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    ArrayString(Vec<String>),
    ArrayF32(Vec<f32>),
    ArrayI32(Vec<i32>),
}

impl GgufValue {
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            GgufValue::U32(v) => {
                put_u32(out, T_U32);
                put_u32(out, *v);
            }
            GgufValue::I32(v) => {
                put_u32(out, T_I32);
                out.extend_from_slice(&v.to_le_bytes());
            }
            GgufValue::F32(v) => {
                put_u32(out, T_F32);
                out.extend_from_slice(&v.to_le_bytes());
            }
            GgufValue::Bool(v) => {
                put_u32(out, T_BOOL);
                out.push(u8::from(*v));
            }
            GgufValue::String(s) => {
                put_u32(out, T_STRING);
                put_str(out, s);
            }
            GgufValue::ArrayString(items) => {
                put_array_header(out, T_STRING, items.len());
                for s in items {
                    put_str(out, s);
                }
            }
            GgufValue::ArrayF32(items) => {
                put_array_header(out, T_F32, items.len());
                for v in items {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            GgufValue::ArrayI32(items) => {
                put_array_header(out, T_I32, items.len());
                for v in items {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

/// One F32 tensor. `dims` are in ggml order: `dims[0]` is the contiguous (fastest-varying) axis,
/// so a `[n_embd, n_vocab]` matrix stores row `v` at `data[v * n_embd..(v + 1) * n_embd]`.
#[derive(Debug, Clone)]
struct Tensor {
    name: String,
    dims: Vec<u64>,
    data: Vec<f32>,
}

/// Accumulates KV pairs and F32 tensors, then serialises them as one GGUF v3 file.
///
/// Keys are written in insertion order; duplicate keys or tensor names are rejected because
/// llama.cpp refuses files that contain them.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    alignment: u32,
    kv: Vec<(String, GgufValue)>,
    tensors: Vec<Tensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// A writer with the default 32-byte alignment. `general.alignment` is only emitted if the
    /// caller adds it (use [`GgufWriter::set_alignment`] to keep the two in step).
    pub fn new() -> Self {
        Self {
            alignment: DEFAULT_ALIGNMENT,
            kv: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the data alignment and records it as `general.alignment` (u32, as llama.cpp requires).
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        ensure!(
            alignment.is_power_of_two(),
            "GGUF alignment must be a power of two, got {alignment}"
        );
        self.alignment = alignment;
        self.kv.retain(|(k, _)| k != "general.alignment");
        self.kv
            .push(("general.alignment".to_owned(), GgufValue::U32(alignment)));
        Ok(())
    }

    /// Adds one metadata pair.
    pub fn add_kv(&mut self, key: impl Into<String>, value: GgufValue) -> Result<()> {
        let key = key.into();
        ensure!(!key.is_empty(), "GGUF keys must not be empty");
        ensure!(
            !self.kv.iter().any(|(k, _)| *k == key),
            "duplicate GGUF key {key:?}"
        );
        self.kv.push((key, value));
        Ok(())
    }

    /// Adds one F32 tensor; `data.len()` must equal the product of `dims` (ggml order).
    pub fn add_tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        data: Vec<f32>,
    ) -> Result<()> {
        let name = name.into();
        // GGML_MAX_NAME is 64 including the terminating NUL; GGML_MAX_DIMS is 4.
        ensure!(
            !name.is_empty() && name.len() < 64,
            "bad tensor name {name:?}"
        );
        ensure!(
            (1..=4).contains(&dims.len()),
            "tensor {name} must have 1..=4 dims"
        );
        let n: u64 = dims.iter().product();
        ensure!(
            n == data.len() as u64,
            "tensor {name}: dims {dims:?} hold {n} elements but {} were given",
            data.len()
        );
        ensure!(
            !self.tensors.iter().any(|t| t.name == name),
            "duplicate tensor name {name:?}"
        );
        self.tensors.push(Tensor {
            name,
            dims: dims.to_vec(),
            data,
        });
        Ok(())
    }

    /// Serialises the whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment as usize;
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        put_u32(&mut out, GGUF_VERSION);
        put_u64(&mut out, self.tensors.len() as u64);
        put_u64(&mut out, self.kv.len() as u64);
        for (key, value) in &self.kv {
            put_str(&mut out, key);
            value.write(&mut out);
        }

        // Tensor infos: offsets are relative to the start of the (aligned) data section.
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            put_u32(&mut out, t.dims.len() as u32);
            for d in &t.dims {
                put_u64(&mut out, *d);
            }
            put_u32(&mut out, GGML_TYPE_F32);
            put_u64(&mut out, offset as u64);
            offset += pad_to(t.data.len() * 4, align);
        }

        if !self.tensors.is_empty() {
            out.resize(pad_to(out.len(), align), 0);
            for t in &self.tensors {
                for v in &t.data {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.resize(pad_to(out.len(), align), 0);
            }
        }
        out
    }

    /// Writes the file via a sibling temporary file and a rename, so a concurrent reader never
    /// sees a half-written model.
    pub fn write_to(&self, path: &Path) -> Result<()> {
        let bytes = self.to_bytes();
        let file_name = path
            .file_name()
            .with_context(|| format!("{} has no file name", path.display()))?;
        let mut tmp_name = file_name.to_os_string();
        tmp_name.push(format!(".tmp{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
        fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
        Ok(())
    }
}

fn pad_to(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_array_header(out: &mut Vec<u8>, elem_type: u32, n: usize) {
    put_u32(out, T_ARRAY);
    put_u32(out, elem_type);
    put_u64(out, n as u64);
}

/// Reads the header, KV metadata and tensor infos of a GGUF file, without touching tensor data,
/// with the node's own parser (`gantry-formats`, fuzzed there), keeping every array item.
pub fn read_gguf_header(path: &Path) -> Result<GgufHeader> {
    let options = ParseOptions {
        keep_array_items: u64::MAX,
        tensor_infos: true,
    };
    read_header_with(path, options)
        .with_context(|| format!("parsing GGUF header of {}", path.display()))
}

/// Reads only the header and KV metadata of a GGUF file (any version 2/3 file, any value type).
/// Numbers map to JSON numbers (non-finite floats to `null`), bools to bools, strings to strings
/// and arrays to JSON arrays.
pub fn read_gguf_metadata(path: &Path) -> Result<BTreeMap<String, serde_json::Value>> {
    Ok(read_gguf_header(path)?
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), json_value(v)))
        .collect())
}

fn json_value(v: &Parsed) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Parsed::Int(i) => Value::from(*i),
        Parsed::Float(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
        Parsed::Bool(b) => Value::Bool(*b),
        Parsed::Str(s) => Value::String(s.clone()),
        Parsed::Array { items, .. } => Value::Array(items.iter().map(json_value).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample_writer() -> GgufWriter {
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", GgufValue::String("llama".into()))
            .expect("kv");
        w.set_alignment(64).expect("alignment");
        w.add_kv("a.u32", GgufValue::U32(7)).expect("kv");
        w.add_kv("a.i32", GgufValue::I32(-3)).expect("kv");
        w.add_kv("a.f32", GgufValue::F32(0.5)).expect("kv");
        w.add_kv("a.bool", GgufValue::Bool(true)).expect("kv");
        w.add_kv(
            "a.strs",
            GgufValue::ArrayString(vec!["x".into(), "▁y".into()]),
        )
        .expect("kv");
        w.add_kv("a.f32s", GgufValue::ArrayF32(vec![1.0, -2.5]))
            .expect("kv");
        w.add_kv("a.i32s", GgufValue::ArrayI32(vec![1, -1, 6]))
            .expect("kv");
        // 3 floats = 12 bytes, so the next tensor needs padding.
        w.add_tensor_f32("t0", &[3], vec![1.0, 2.0, 3.0])
            .expect("tensor");
        w.add_tensor_f32("t1", &[2, 5], (0..10).map(|i| i as f32).collect())
            .expect("tensor");
        w
    }

    #[test]
    fn round_trips_metadata_and_tensor_infos() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x.gguf");
        let w = sample_writer();
        w.write_to(&path).expect("write");

        let h = read_gguf_header(&path).expect("read");
        assert_eq!(h.version, 3);
        assert_eq!(h.alignment, 64);
        let m = read_gguf_metadata(&path).expect("metadata");
        assert_eq!(m["general.architecture"], json!("llama"));
        assert_eq!(m["general.alignment"], json!(64));
        assert_eq!(m["a.u32"], json!(7));
        assert_eq!(m["a.i32"], json!(-3));
        assert_eq!(m["a.f32"], json!(0.5));
        assert_eq!(m["a.bool"], json!(true));
        assert_eq!(m["a.strs"], json!(["x", "▁y"]));
        assert_eq!(m["a.f32s"], json!([1.0, -2.5]));
        assert_eq!(m["a.i32s"], json!([1, -1, 6]));

        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[0].name, "t0");
        assert_eq!(h.tensors[0].dims, vec![3]);
        assert_eq!(h.tensors[0].offset, 0);
        assert_eq!(h.tensors[1].dims, vec![2, 5]);
        assert_eq!(
            h.tensors[1].offset, 64,
            "second tensor starts at the next 64-byte boundary"
        );
        assert!(h.tensors.iter().all(|t| t.ggml_type == GGML_TYPE_F32));
        assert_eq!(h.data_offset % 64, 0);

        let bytes = fs::read(&path).expect("read bytes");
        // Data section = 64 (t0 padded) + 64 (t1's 40 bytes padded).
        assert_eq!(bytes.len() as u64, h.data_offset + 128);
        let at = (h.data_offset + h.tensors[1].offset) as usize;
        let v = f32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("4 bytes"));
        assert_eq!(v, 1.0);
        // Header padding is zeros.
        let header_end = bytes.len() - 128;
        assert_eq!(header_end as u64, h.data_offset);
    }

    #[test]
    fn rejects_bad_input() {
        let mut w = GgufWriter::new();
        w.add_kv("k", GgufValue::U32(1)).expect("kv");
        assert!(w.add_kv("k", GgufValue::U32(2)).is_err(), "duplicate key");
        assert!(w.add_kv("", GgufValue::U32(2)).is_err(), "empty key");
        assert!(w.set_alignment(48).is_err(), "not a power of two");
        assert!(
            w.add_tensor_f32("t", &[2, 2], vec![0.0; 3]).is_err(),
            "wrong element count"
        );
        w.add_tensor_f32("t", &[1], vec![0.0]).expect("tensor");
        assert!(
            w.add_tensor_f32("t", &[1], vec![0.0]).is_err(),
            "duplicate tensor"
        );
    }

    #[test]
    fn reader_rejects_garbage_and_truncation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bad.gguf");
        fs::write(&path, b"NOPE0000000000000000000000").expect("write");
        assert!(read_gguf_metadata(&path).is_err());

        let bytes = sample_writer().to_bytes();
        fs::write(&path, &bytes[..40]).expect("write");
        assert!(read_gguf_metadata(&path).is_err());

        // A string length far beyond the file size fails cleanly instead of allocating.
        let mut evil = Vec::new();
        evil.extend_from_slice(b"GGUF");
        put_u32(&mut evil, 3);
        put_u64(&mut evil, 0);
        put_u64(&mut evil, 1);
        put_u64(&mut evil, u64::MAX / 2);
        fs::write(&path, &evil).expect("write");
        assert!(read_gguf_metadata(&path).is_err());
    }
}
