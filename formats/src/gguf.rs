//! Model metadata (before engine selection and loading): reads a GGUF file's header without
//! touching its weights.
//!
//! Only the key/value section is read: `general.architecture`, the context
//! length, the chat template and the file type decide which engine may serve
//! the model and how; the attention shape gives the KV-cache size the node's
//! memory policy estimates before a load. Every length is checked against the
//! bytes left in the file before anything is allocated, so a hostile header
//! cannot make the node allocate gigabytes or loop (`fuzz/` exercises this).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// A metadata value; arrays keep only their element type and length, except
/// for short arrays of strings/numbers, which are kept whole.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array { len: u64, items: Vec<GgufValue> },
}

impl GgufValue {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            GgufValue::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GgufHeader {
    pub version: u32,
    pub tensor_count: u64,
    pub metadata: BTreeMap<String, GgufValue>,
    /// The tensor infos; read only with [`ParseOptions::tensor_infos`], else empty.
    pub tensors: Vec<GgufTensorInfo>,
    /// `general.alignment` (32 when absent).
    pub alignment: u64,
    /// Absolute file offset of the data section (padded to the alignment); 0 unless the tensor
    /// infos were read.
    pub data_offset: u64,
}

/// One tensor info as stored in a GGUF header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is contiguous.
    pub dims: Vec<u64>,
    /// `ggml_type` id (0 = F32).
    pub ggml_type: u32,
    /// Offset relative to the start of the data section.
    pub offset: u64,
}

/// How much of a header to keep. The node reads only the key/value section and keeps short
/// arrays ([`ParseOptions::default`]); tools that inspect a file (the test kit) keep everything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParseOptions {
    /// Items kept of each array (the rest are read and counted, not stored).
    pub keep_array_items: u64,
    /// Also read the tensor infos and the data section's offset.
    pub tensor_infos: bool,
}

impl Default for ParseOptions {
    fn default() -> Self {
        ParseOptions {
            keep_array_items: 64,
            tensor_infos: false,
        }
    }
}

/// llama.cpp's `GGUF_DEFAULT_ALIGNMENT`.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// `GGML_MAX_DIMS`.
const MAX_TENSOR_DIMS: u32 = 4;

impl GgufHeader {
    pub fn architecture(&self) -> Option<&str> {
        self.metadata
            .get("general.architecture")
            .and_then(GgufValue::as_str)
    }
    pub fn context_length(&self) -> Option<u64> {
        let arch = self.architecture()?;
        self.metadata
            .get(&format!("{arch}.context_length"))
            .and_then(GgufValue::as_u64)
    }
    pub fn chat_template(&self) -> Option<&str> {
        self.metadata
            .get("tokenizer.chat_template")
            .and_then(GgufValue::as_str)
    }
    pub fn file_type(&self) -> Option<u64> {
        self.metadata
            .get("general.file_type")
            .and_then(GgufValue::as_u64)
    }

    /// An integer under the architecture's prefix, e.g. `llama.block_count`.
    fn arch_u64(&self, suffix: &str) -> Option<u64> {
        let arch = self.architecture()?;
        self.metadata
            .get(&format!("{arch}.{suffix}"))
            .and_then(GgufValue::as_u64)
    }

    /// Bytes of KV cache one context cell takes across all layers, at f16
    /// (llama.cpp's default K/V type): `layers x kv_heads x (key + value
    /// head size) x 2`. `None` when the header lacks the attention shape or
    /// the product overflows (a hostile header). Per-layer head counts (an
    /// array) count at their largest, so the figure is an upper bound.
    pub fn kv_bytes_per_token(&self) -> Option<u64> {
        let layers = self.arch_u64("block_count")?;
        let heads = self.arch_u64("attention.head_count")?;
        let arch = self.architecture()?;
        let kv_heads = match self
            .metadata
            .get(&format!("{arch}.attention.head_count_kv"))
        {
            None => heads,
            Some(GgufValue::Array { items, .. }) => {
                items.iter().filter_map(GgufValue::as_u64).max()?
            }
            Some(v) => v.as_u64()?,
        };
        let key = match self.arch_u64("attention.key_length") {
            Some(k) => k,
            None => self
                .arch_u64("embedding_length")?
                .checked_div(heads)
                .filter(|k| *k > 0)?,
        };
        let value = self.arch_u64("attention.value_length").unwrap_or(key);
        const F16_BYTES: u64 = 2;
        layers
            .checked_mul(kv_heads)?
            .checked_mul(key.checked_add(value)?)?
            .checked_mul(F16_BYTES)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GgufError {
    #[error("not a GGUF file (magic {0:02x?})")]
    Magic([u8; 4]),
    #[error("unsupported GGUF version {0}")]
    Version(u32),
    #[error("truncated GGUF header: {0}")]
    Truncated(&'static str),
    #[error("GGUF header value type {0} is unknown")]
    ValueType(u32),
    #[error("GGUF header declares {what} of {len}, more than the file holds")]
    TooLong { what: &'static str, len: u64 },
    #[error("GGUF key is not UTF-8")]
    Utf8,
    #[error("GGUF key {0:?} appears twice")]
    DuplicateKey(String),
    #[error("GGUF general.alignment must be a power of two")]
    Alignment,
    #[error("GGUF tensor {name:?}: {reason}")]
    Tensor { name: String, reason: String },
    #[error("cannot read GGUF file: {0}")]
    Io(String),
}

/// Arrays nest at most this deep (GGUF allows arrays of arrays).
const MAX_DEPTH: u32 = 4;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    keep_array_items: u64,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        if n > self.left() {
            return Err(GgufError::Truncated(what));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > self.left() {
            return Err(GgufError::TooLong { what, len });
        }
        let b = self.take(len, what)?;
        Ok(String::from_utf8_lossy(b).into_owned())
    }
    fn tensor_info(&mut self) -> Result<GgufTensorInfo, GgufError> {
        let name = self.string("tensor name")?;
        let n_dims = self.u32("tensor dims")?;
        if n_dims > MAX_TENSOR_DIMS {
            return Err(GgufError::Tensor {
                name,
                reason: format!("{n_dims} dimensions, at most {MAX_TENSOR_DIMS}"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64("tensor dim")?);
        }
        let ggml_type = self.u32("tensor type")?;
        let offset = self.u64("tensor offset")?;
        Ok(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        })
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<GgufValue, GgufError> {
        let le = |b: &[u8]| {
            let mut a = [0u8; 8];
            a[..b.len()].copy_from_slice(b);
            a
        };
        Ok(match ty {
            0 => GgufValue::Int(i64::from(self.take(1, "u8")?[0])),
            1 => GgufValue::Int(i64::from(self.take(1, "i8")?[0] as i8)),
            2 => {
                let b = self.take(2, "u16")?;
                GgufValue::Int(i64::from(u16::from_le_bytes([b[0], b[1]])))
            }
            3 => {
                let b = self.take(2, "i16")?;
                GgufValue::Int(i64::from(i16::from_le_bytes([b[0], b[1]])))
            }
            4 => GgufValue::Int(i64::from(self.u32("u32")?)),
            5 => GgufValue::Int(i64::from(self.u32("i32")? as i32)),
            6 => GgufValue::Float(f64::from(f32::from_bits(self.u32("f32")?))),
            7 => GgufValue::Bool(self.take(1, "bool")?[0] != 0),
            8 => GgufValue::Str(self.string("string")?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(GgufError::TooLong {
                        what: "array nesting",
                        len: u64::from(depth),
                    });
                }
                let elem = self.u32("array type")?;
                let len = self.u64("array length")?;
                // Every element takes at least one byte: reject impossible lengths up front.
                if len > self.left() {
                    return Err(GgufError::TooLong { what: "array", len });
                }
                let mut items = Vec::new();
                for i in 0..len {
                    let v = self.value(elem, depth + 1)?;
                    if i < self.keep_array_items {
                        items.push(v);
                    }
                }
                GgufValue::Array { len, items }
            }
            10 => GgufValue::Int(u64::from_le_bytes(le(self.take(8, "u64")?)) as i64),
            11 => GgufValue::Int(i64::from_le_bytes(le(self.take(8, "i64")?))),
            12 => GgufValue::Float(f64::from_le_bytes(le(self.take(8, "f64")?))),
            other => return Err(GgufError::ValueType(other)),
        })
    }
}

/// Parse a header from bytes (the start of a file; may be the whole file).
/// The key/value section of a GGUF file in `buf`, keeping short arrays (what the node needs).
pub fn parse_header(buf: &[u8]) -> Result<GgufHeader, GgufError> {
    parse_header_with(buf, ParseOptions::default())
}

/// A GGUF header in `buf`, as much of it as `options` asks for.
pub fn parse_header_with(buf: &[u8], options: ParseOptions) -> Result<GgufHeader, GgufError> {
    let mut c = Cursor {
        buf,
        pos: 0,
        keep_array_items: options.keep_array_items,
    };
    let magic = c.take(4, "magic")?;
    if magic != b"GGUF" {
        let mut m = [0u8; 4];
        m.copy_from_slice(magic);
        return Err(GgufError::Magic(m));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version(version));
    }
    let tensor_count = c.u64("tensor count")?;
    let kv_count = c.u64("kv count")?;
    if kv_count > buf.len() as u64 {
        return Err(GgufError::TooLong {
            what: "kv count",
            len: kv_count,
        });
    }
    let mut metadata = BTreeMap::new();
    for _ in 0..kv_count {
        let key = c.string("key")?;
        let ty = c.u32("value type")?;
        let v = c.value(ty, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, v);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v
            .as_u64()
            .filter(|a| a.is_power_of_two())
            .ok_or(GgufError::Alignment)?,
    };
    let mut header = GgufHeader {
        version,
        tensor_count,
        metadata,
        tensors: Vec::new(),
        alignment,
        data_offset: 0,
    };
    if options.tensor_infos {
        // A tensor info takes at least 8 + 4 + 4 + 8 bytes.
        if tensor_count.saturating_mul(24) > c.left() {
            return Err(GgufError::TooLong {
                what: "tensor count",
                len: tensor_count,
            });
        }
        for _ in 0..tensor_count {
            header.tensors.push(c.tensor_info()?);
        }
        header.data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    }
    Ok(header)
}

/// Read and parse a file's header. Reads at most `limit` bytes (headers with
/// large vocabularies run to a few MiB; 64 MiB is far above any real one).
/// The key/value section of the GGUF file at `path` (its first 64 MiB at most).
pub fn read_header(path: &Path) -> Result<GgufHeader, GgufError> {
    read_header_with(path, ParseOptions::default())
}

/// The header of the GGUF file at `path` (its first 64 MiB at most), as `options` asks.
pub fn read_header_with(path: &Path, options: ParseOptions) -> Result<GgufHeader, GgufError> {
    const LIMIT: u64 = 64 << 20;
    let f = std::fs::File::open(path).map_err(|e| GgufError::Io(e.to_string()))?;
    let mut buf = Vec::new();
    f.take(LIMIT)
        .read_to_end(&mut buf)
        .map_err(|e| GgufError::Io(e.to_string()))?;
    parse_header_with(&buf, options)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_tiny_models_header() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("t.gguf");
        gantry_testkit::write_tiny_gguf(&p, &gantry_testkit::TinyModelSpec::default())
            .expect("write");
        let h = read_header(&p).expect("header");
        assert_eq!(h.architecture(), Some("llama"));
        assert_eq!(h.context_length(), Some(2048));
        assert!(h.chat_template().is_some_and(|t| t.contains("im_start")));
        assert_eq!(h.file_type(), Some(0));
        assert!(
            matches!(h.metadata.get("tokenizer.ggml.tokens"), Some(GgufValue::Array { len, .. }) if *len > 256)
        );
    }

    #[test]
    fn kv_bytes_per_token_follows_the_attention_shape() {
        let spec = gantry_testkit::TinyModelSpec::default();
        let bytes = gantry_testkit::tiny_gguf_writer(&spec)
            .expect("writer")
            .to_bytes();
        let h = parse_header(&bytes).expect("header");
        // 2 layers x 2 KV heads x (16 + 16) head dims x 2 bytes.
        let head = u64::from(spec.n_embd / spec.n_head);
        assert_eq!(
            h.kv_bytes_per_token(),
            Some(u64::from(spec.n_layer) * u64::from(spec.n_head_kv) * 2 * head * 2)
        );
        assert_eq!(h.kv_bytes_per_token(), Some(256));

        let mut h = GgufHeader::default();
        let put = |h: &mut GgufHeader, k: &str, v: GgufValue| {
            h.metadata.insert(k.to_string(), v);
        };
        put(&mut h, "general.architecture", GgufValue::Str("x".into()));
        assert_eq!(h.kv_bytes_per_token(), None, "no shape, no estimate");
        put(&mut h, "x.block_count", GgufValue::Int(3));
        put(&mut h, "x.attention.head_count", GgufValue::Int(8));
        put(&mut h, "x.attention.key_length", GgufValue::Int(128));
        put(&mut h, "x.attention.value_length", GgufValue::Int(64));
        put(
            &mut h,
            "x.attention.head_count_kv",
            GgufValue::Array {
                len: 3,
                items: vec![GgufValue::Int(2), GgufValue::Int(4), GgufValue::Int(1)],
            },
        );
        assert_eq!(h.kv_bytes_per_token(), Some(3 * 4 * (128 + 64) * 2));
        put(&mut h, "x.block_count", GgufValue::Int(i64::MAX));
        assert_eq!(h.kv_bytes_per_token(), None, "overflow is no estimate");
    }

    #[test]
    fn hostile_headers_fail_cleanly() {
        assert!(matches!(
            parse_header(b"GGUX\x03\0\0\0"),
            Err(GgufError::Magic(_))
        ));
        assert!(matches!(
            parse_header(b"GGUF"),
            Err(GgufError::Truncated(_))
        ));
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&u64::MAX.to_le_bytes()); // absurd kv count
        assert!(matches!(parse_header(&b), Err(GgufError::TooLong { .. })));
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&(1u64 << 40).to_le_bytes()); // key longer than the file
        assert!(matches!(parse_header(&b), Err(GgufError::TooLong { .. })));
    }
}
