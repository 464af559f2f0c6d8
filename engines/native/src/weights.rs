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
    shards: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, TensorInfo>,
}

impl Weights {
    /// Map the model's weights: `primary` is a `.safetensors` file or an index.
    pub fn open(dir: &Path, primary: &Path) -> Result<Self, EngineError> {
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
                    other => {
                        return Err(EngineError::new(
                            Status::Unsupported,
                            format!(
                                "tensor {name} in {} is {other:?}; the native engine runs bf16, f16 and f32 weights",
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
            shards.push((path, map));
        }
        Ok(Self { shards, tensors })
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

    /// A tensor converted to f32 (small tensors: norms, biases).
    pub fn to_f32(&self, t: &TensorInfo) -> Vec<f32> {
        to_f32(self.bytes(t), t.dtype)
    }

    /// Bytes of every mapping (weights resident once paged in).
    pub fn mapped_bytes(&self) -> u64 {
        self.shards.iter().map(|(_, m)| m.len() as u64).sum()
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }
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
