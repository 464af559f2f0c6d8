//! Native engine, load step 2: the safetensors shards, memory-mapped, and typed views of tensors.
//!
//! One file (`model.safetensors`) or the shards an index (`model.safetensors.index.json`) names.
//! Each shard is mapped read-only once; the `safetensors` crate checks its header and that
//! every tensor's bytes lie inside the file (a truncated shard is refused here, naming it).
//! Large matrices stay in the mapping and are read in place; only small tensors (norms,
//! biases) and matrices the CPU cannot run in their stored type are copied, converted to f32.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use gantry_engine_abi::{EngineError, Status};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

fn corrupt(msg: impl Into<String>) -> EngineError {
    EngineError::new(Status::ModelCorrupt, msg.into())
}

/// Element types this engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    Bf16,
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

/// Where one tensor's bytes are.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub shard: usize,
    pub offset: usize,
    pub len: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// Every tensor of the model, by name, over the mapped shards.
pub struct Weights {
    shards: Vec<(PathBuf, Backing)>,
    tensors: HashMap<String, TensorInfo>,
    /// MXFP4 tensors (`*_blocks`, `*_scales`, `uint8`), kept apart from the float tensors until
    /// the loader that knows their layout dequantizes them ([`Weights::packed`]).
    packed: HashMap<String, (usize, usize, usize, Vec<usize>)>,
}

/// Tensors made at load (FP8 weights dequantized, experts rearranged), gathered into one
/// owned shard that [`Weights::add`] joins to the mapped ones.
pub struct Made {
    label: &'static str,
    bytes: Vec<u8>,
    infos: Vec<(String, TensorInfo)>,
}

impl Made {
    /// Room for `total` bytes, or `OOM_RAM`.
    pub fn with_capacity(label: &'static str, total: usize) -> Result<Self, EngineError> {
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(total).map_err(|_| {
            EngineError::new(
                Status::OomRam,
                format!("cannot allocate {total} bytes for the {label}"),
            )
        })?;
        Ok(Self {
            label,
            bytes,
            infos: Vec::new(),
        })
    }

    /// A tensor of `shape` in `dtype` whose values `values` yields in row-major order.
    pub fn push(
        &mut self,
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        values: impl Iterator<Item = f32>,
    ) {
        let offset = self.bytes.len();
        for v in values {
            match dtype {
                DType::Bf16 => self
                    .bytes
                    .extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
                DType::F16 => self
                    .bytes
                    .extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                DType::F32 => self.bytes.extend_from_slice(&v.to_le_bytes()),
            }
        }
        let len = self.bytes.len() - offset;
        debug_assert_eq!(len, shape.iter().product::<usize>() * dtype.size());
        self.infos.push((
            name,
            TensorInfo {
                shard: usize::MAX,
                offset,
                len,
                dtype,
                shape,
            },
        ));
    }
}

/// A shard's bytes: the file mapped, or values made at load (FP8 weights dequantized).
enum Backing {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// How a checkpoint's FP8 weights are scaled (`quantization_config` of `quant_method: fp8`):
/// each `X.weight` in `float8_e4m3fn` comes with `X.weight_scale_inv`, one f32 factor per
/// `block` of the matrix (`weight_block_size`), or one for the whole matrix without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8 {
    pub block: Option<[usize; 2]>,
}

impl Weights {
    /// Map the model's weights: `primary` is a `.safetensors` file or an index.
    pub fn open(dir: &Path, primary: &Path) -> Result<Self, EngineError> {
        Self::open_quantized(dir, primary, None, false)
    }

    /// [`Weights::open`] for a checkpoint whose linear layers may be FP8 (`fp8`): each FP8
    /// weight is dequantized once, at load, to bf16 in memory of its own, and is a bf16
    /// tensor from then on (every backend reads it as such). Without `fp8`, an FP8 tensor is
    /// refused. With `mxfp4`, `uint8` tensors named `*_blocks` and `*_scales` are kept apart
    /// for the loader ([`Weights::packed`]); without it they are refused.
    pub fn open_quantized(
        dir: &Path,
        primary: &Path,
        fp8: Option<Fp8>,
        mxfp4: bool,
    ) -> Result<Self, EngineError> {
        let index = if primary
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".index.json"))
        {
            Some(primary.to_path_buf())
        } else if primary.is_dir() || !primary.exists() {
            let p = dir.join("model.safetensors.index.json");
            p.is_file().then_some(p)
        } else {
            None
        };
        let files: Vec<PathBuf> = match &index {
            Some(index) => shard_list(dir, index)?,
            None if primary.is_file() => vec![primary.to_path_buf()],
            None => {
                let p = dir.join("model.safetensors");
                if !p.is_file() {
                    return Err(EngineError::new(
                        Status::LoadFailed,
                        format!(
                            "{} holds neither model.safetensors nor model.safetensors.index.json",
                            dir.display()
                        ),
                    ));
                }
                vec![p]
            }
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        let mut packed = HashMap::new();
        // FP8 weights found while mapping, dequantized once every shard is mapped (their
        // scales may live in another shard).
        let mut fp8_weights: Vec<(String, usize, usize, usize, Vec<usize>)> = Vec::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| {
                EngineError::new(
                    Status::LoadFailed,
                    format!("cannot open {}: {e}", path.display()),
                )
            })?;
            // SAFETY: the mapping is read-only and lives as long as `Weights`. Model artifacts
            // are not modified while served; a file truncated under a live mapping would fault
            // on access, which is why the store writes artifacts under temporary names and
            // renames them into place.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| {
                EngineError::new(
                    Status::LoadFailed,
                    format!("cannot map {}: {e}", path.display()),
                )
            })?;
            #[cfg(unix)]
            let _ = map.advise(memmap2::Advice::WillNeed);
            let st = SafeTensors::deserialize(&map).map_err(|e| {
                corrupt(format!(
                    "{} is not a valid safetensors file (truncated or damaged): {e}",
                    path.display()
                ))
            })?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let dtype = match view.dtype() {
                    Dtype::BF16 => DType::Bf16,
                    Dtype::F16 => DType::F16,
                    Dtype::F32 => DType::F32,
                    // Integer buffers older transformers saved beside the weights (BERT's
                    // `embeddings.position_ids`, 0..n): recomputed, never read.
                    Dtype::I64 if name.ends_with("position_ids") => continue,
                    Dtype::F8_E4M3 if fp8.is_some() => {
                        let data = view.data();
                        fp8_weights.push((
                            name.clone(),
                            i,
                            data.as_ptr() as usize - base,
                            data.len(),
                            view.shape().to_vec(),
                        ));
                        continue;
                    }
                    Dtype::U8
                        if mxfp4 && (name.ends_with("_blocks") || name.ends_with("_scales")) =>
                    {
                        let data = view.data();
                        let at = (i, data.as_ptr() as usize - base, data.len());
                        packed.insert(name.clone(), (at.0, at.1, at.2, view.shape().to_vec()));
                        continue;
                    }
                    other => {
                        return Err(EngineError::new(
                            Status::Unsupported,
                            format!(
                                "tensor {name} in {} is {other:?}; the native engine runs bf16, f16 and f32 weights (and float8_e4m3fn ones with a `quant_method: fp8` quantization_config, MXFP4 experts with `mxfp4`)",
                                path.display()
                            ),
                        ));
                    }
                };
                let data = view.data();
                let info = TensorInfo {
                    shard: i,
                    offset: data.as_ptr() as usize - base,
                    len: data.len(),
                    dtype,
                    shape: view.shape().to_vec(),
                };
                if tensors.insert(name.clone(), info).is_some() {
                    return Err(corrupt(format!("tensor {name} appears in two shards")));
                }
            }
            shards.push((path, Backing::Mapped(map)));
        }
        let mut weights = Self {
            shards,
            tensors,
            packed,
        };
        if let Some(fp8) = fp8 {
            weights.dequantize(fp8, fp8_weights)?;
        }
        Ok(weights)
    }

    /// Dequantize the FP8 weights into one owned bf16 shard: `w = q · scale_inv[block]`.
    fn dequantize(
        &mut self,
        fp8: Fp8,
        found: Vec<(String, usize, usize, usize, Vec<usize>)>,
    ) -> Result<(), EngineError> {
        let total: usize = found.iter().map(|f| f.3 * 2).sum();
        let mut made = Made::with_capacity("FP8 weights dequantized to bf16", total)?;
        for (name, src, offset, len, shape) in found {
            let [rows, cols] = shape[..] else {
                return Err(corrupt(format!(
                    "FP8 tensor {name} has shape {shape:?}; only matrices are FP8 here"
                )));
            };
            let scale_name = format!("{name}_scale_inv");
            let scale_t = self.get(&scale_name).ok_or_else(|| {
                corrupt(format!(
                    "FP8 tensor {name} has no {scale_name} beside it (quant_method fp8)"
                ))
            })?;
            let scales = self.to_f32(scale_t);
            let (br, bc) = match fp8.block {
                Some([br, bc]) => (br, bc),
                None => (rows, cols),
            };
            let want = rows.div_ceil(br) * cols.div_ceil(bc);
            if scales.len() != want {
                return Err(corrupt(format!(
                    "{scale_name} has {} values; {rows}x{cols} in blocks of {br}x{bc} needs {want}",
                    scales.len()
                )));
            }
            let q = &self.shards[src].1[offset..offset + len];
            let per_row = cols.div_ceil(bc);
            let values = (0..rows * cols).map(|i| {
                let (r, c) = (i / cols, i % cols);
                e4m3_to_f32(q[i]) * scales[(r / br) * per_row + c / bc]
            });
            made.push(name, DType::Bf16, shape, values);
        }
        self.add(made);
        Ok(())
    }

    /// Join the tensors made at load; a name already mapped now reads the made tensor.
    pub fn add(&mut self, made: Made) {
        let shard = self.shards.len();
        for (name, mut info) in made.infos {
            info.shard = shard;
            self.tensors.insert(name, info);
        }
        self.shards.push((
            PathBuf::from(format!("({})", made.label)),
            Backing::Owned(made.bytes),
        ));
    }

    /// An MXFP4 tensor kept apart at open (`uint8`): its bytes and shape.
    pub fn packed(&self, name: &str) -> Option<(&[u8], &[usize])> {
        self.packed.get(name).map(|(shard, offset, len, shape)| {
            (&self.shards[*shard].1[*offset..offset + len], &shape[..])
        })
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A tensor that must exist with exactly this shape.
    pub fn expect(&self, name: &str, shape: &[usize]) -> Result<&TensorInfo, EngineError> {
        let t = self.get(name).ok_or_else(|| {
            corrupt(format!(
                "tensor {name} is missing from the safetensors files"
            ))
        })?;
        if t.shape != shape {
            return Err(corrupt(format!(
                "tensor {name} has shape {:?}, the config says {shape:?}",
                t.shape
            )));
        }
        Ok(t)
    }

    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.shards[t.shard].1[t.offset..t.offset + t.len]
    }

    /// Rows `start..start + rows` of `t` read as a matrix of its last dimension's columns
    /// (`[a][b][cols]` is `a × b` rows): one expert's slice of a tensor holding every expert.
    pub fn rows_of(&self, t: &TensorInfo, start: usize, rows: usize) -> TensorInfo {
        let cols = *t.shape.last().expect("a tensor has a shape");
        let row_bytes = cols * t.dtype.size();
        TensorInfo {
            shard: t.shard,
            offset: t.offset + start * row_bytes,
            len: rows * row_bytes,
            dtype: t.dtype,
            shape: vec![rows, cols],
        }
    }

    /// A tensor converted to f32 (small tensors: norms, biases).
    pub fn to_f32(&self, t: &TensorInfo) -> Vec<f32> {
        to_f32(self.bytes(t), t.dtype)
    }

    /// Bytes of every mapping (weights resident once paged in) and of the weights made at load.
    pub fn mapped_bytes(&self) -> u64 {
        self.shards.iter().map(|(_, m)| m.len() as u64).sum()
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }
}

/// One `float8_e4m3fn` value (OCP FP8: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits;
/// no infinities, `S.1111.111` is NaN). Written out here: the format is fixed, the function is
/// a few lines, and the crates that have it bring a tensor library along.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0f);
    let man = f32::from(b & 0x07);
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let v = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * v
}

/// Decode little-endian `dtype` bytes to f32.
pub fn to_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

/// The shard files an index names, each once, in first-mention order.
fn shard_list(dir: &Path, index: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let text = std::fs::read(index)
        .map_err(|e| EngineError::new(Status::LoadFailed, format!("{}: {e}", index.display())))?;
    let v: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| corrupt(format!("{} is not valid JSON: {e}", index.display())))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| corrupt(format!("{} has no `weight_map` object", index.display())))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let name = file.as_str().ok_or_else(|| {
            corrupt(format!(
                "{} `weight_map.{tensor}` must be a file name",
                index.display()
            ))
        })?;
        // Shards live beside the index; a path that leaves the directory is refused.
        if name.contains('/') || name.contains('\\') || name.starts_with('.') {
            return Err(corrupt(format!(
                "{} `weight_map.{tensor}` names {name}, not a file beside the index",
                index.display()
            )));
        }
        let p = dir.join(name);
        if !files.contains(&p) {
            if !p.is_file() {
                return Err(corrupt(format!(
                    "shard {name} named by {} is missing",
                    index.display()
                )));
            }
            files.push(p);
        }
    }
    if files.is_empty() {
        return Err(corrupt(format!("{} names no shards", index.display())));
    }
    Ok(files)
}
