//! llama.cpp engine, LoRA adapters (ABI 1.6, below the engine host's `adapter_load`,
//! `adapter_unload` and `seq_set_adapter`): a GGUF LoRA checked against the base model's
//! tensors, loaded through llama.cpp, and the adapter the context runs with.
//!
//! llama.cpp applies adapters to a whole context, not to a sequence, so `step.rs` decodes a
//! step's entries in one group per adapter and sets the context's adapter before each group's
//! decode ([`Exec::use_adapter`]). Each switch makes llama.cpp re-reserve its compute graph on
//! the next decode, so the context keeps whatever it ran last: a step whose entries all run
//! one adapter (or the base) costs what it did before adapters.
//!
//! The file is checked here before llama.cpp reads it ([`check_fit`]): llama.cpp refuses a
//! mismatched adapter too, but with a null and a log line, while the host needs a message that
//! names the tensor and both shapes. A sequence's adapter is fixed before its first step, so
//! its KV is computed under one adapter only; warm slots are keyed by it (`slots.rs`).

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;

use crate::gguf_info::{self, GgufInfo, TensorInfo};
use gantry_engine_abi::{AdapterDescriptor, EngineError, Format, LoadedAdapter, Status};
use llama_cpp_2::model::{LlamaLoraAdapter, LlamaModel};
use llama_cpp_sys_2::{llama_adapter_lora, llama_model};

use crate::slots::Exec;
use crate::{LlamaLoaded, logging, oom};

/// A LoRA adapter llama.cpp loaded for this model. Freed on drop, which must come before the
/// model's (`LlamaLoaded`'s `Drop` sees to it).
pub(crate) struct LoraAdapter {
    raw: NonNull<llama_adapter_lora>,
    /// The host's multiplier; llama.cpp multiplies it by the file's alpha / rank itself.
    scale: f32,
    name: String,
}

impl LoraAdapter {
    /// The adapter as llama-cpp-2's wrapper, for its context calls. The wrapper frees nothing
    /// (it has no `Drop`; `ManuallyDrop` says so at the type).
    fn wrapper(&self) -> ManuallyDrop<LlamaLoraAdapter> {
        // SAFETY: `LlamaLoraAdapter` is `#[repr(transparent)]` over llama-cpp-2's `Ptr`, itself
        // `#[repr(transparent)]` over `NonNull<llama_adapter_lora>` (llama-cpp-2 is pinned to
        // one version in the workspace; `transmute` checks the sizes at compile time). The
        // pointer is a live adapter of this model until `self` drops.
        ManuallyDrop::new(unsafe {
            std::mem::transmute::<NonNull<llama_adapter_lora>, LlamaLoraAdapter>(self.raw)
        })
    }
}

impl Drop for LoraAdapter {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `llama_adapter_lora_init` and is freed once, here; its model
        // is still alive and no context runs with it (`Exec::unload_adapter` and
        // `LlamaLoaded`'s `Drop` clear the context's adapter or drop the context first).
        unsafe { llama_cpp_sys_2::llama_adapter_lora_free(self.raw.as_ptr()) }
    }
}

/// llama.cpp's pointer to `model`, for the calls llama-cpp-2 does not wrap for a shared model
/// (its `lora_adapter_init` takes `&mut LlamaModel`, which a model shared with tokenizing
/// threads cannot give).
pub(crate) fn raw_model(model: &LlamaModel) -> *mut llama_model {
    // SAFETY: `LlamaModel` is `#[repr(transparent)]` over `Ptr<llama_model>`, itself
    // `#[repr(transparent)]` over `NonNull<llama_model>`, so the struct's one field is the
    // pointer (the assertion below checks the size against the pinned version).
    unsafe { std::ptr::from_ref(model).cast::<*mut llama_model>().read() }
}
const _: () = assert!(size_of::<LlamaModel>() == size_of::<*mut llama_model>());

/// `[a, b]` as the message shows a shape (GGUF order, first dimension contiguous).
fn shape(dims: &[u64]) -> String {
    let d: Vec<String> = dims.iter().map(u64::to_string).collect();
    format!("[{}]", d.join(", "))
}

/// Why a tensor pair does not fit its base tensor, or `None`. In GGUF order a base weight is
/// `[in, out]`, its `lora_a` `[in, r]` and `lora_b` `[r, out]`; the token embedding's pair is
/// flipped (`lora_a` `[r, n_vocab]`, `lora_b` `[r, n_embd]`, llama.cpp's `llm_build_inp_embd`).
fn pair_misfit(target: &str, a: &[u64], b: &[u64], base: &[u64]) -> Option<String> {
    let (ta, tb) = (format!("{target}.lora_a"), format!("{target}.lora_b"));
    if a.len() != 2 || b.len() != 2 || base.len() != 2 {
        return Some(format!(
            "`{ta}` {} and `{tb}` {} must be matrices like their base `{target}` {}",
            shape(a),
            shape(b),
            shape(base)
        ));
    }
    let both = format!(
        "`{ta}` is {}, `{tb}` {}, the base `{target}` {}",
        shape(a),
        shape(b),
        shape(base)
    );
    let (rank_a, rank_b) = if target.ends_with("token_embd.weight") {
        if b[1] != base[0] || a[1] != base[1] {
            return Some(format!(
                "{both}: a token-embedding pair must be [r, {}] and [r, {}]",
                base[1], base[0]
            ));
        }
        (a[0], b[0])
    } else {
        if a[0] != base[0] {
            return Some(format!(
                "{both}: lora_a's first dimension must be the base's input size {}",
                base[0]
            ));
        }
        if b[1] != base[1] {
            return Some(format!(
                "{both}: lora_b's second dimension must be the base's output size {}",
                base[1]
            ));
        }
        (a[1], b[0])
    };
    if rank_a != rank_b {
        return Some(format!("{both}: the two ranks differ ({rank_a}, {rank_b})"));
    }
    if rank_a == 0 {
        return Some(format!("{both}: its rank is 0"));
    }
    None
}

fn meta_str<'a>(h: &'a GgufInfo, key: &str) -> Option<&'a str> {
    h.get(key)
}

/// Whether the LoRA adapter `adapter` (its GGUF header, tensor infos read) fits a model of
/// architecture `arch` whose tensors have the shapes `base`; else the refusal's message, which
/// names the first tensor that does not fit with both shapes and counts the others.
pub(crate) fn check_fit(
    name: &str,
    adapter: &GgufInfo,
    arch: &str,
    base: &HashMap<String, Vec<u64>>,
) -> Result<(), String> {
    let kind = meta_str(adapter, "general.type").unwrap_or("");
    if kind != "adapter" {
        return Err(format!(
            "adapter `{name}` is not an adapter: its general.type is `{kind}`, not `adapter`"
        ));
    }
    let kind = meta_str(adapter, "adapter.type").unwrap_or("");
    if kind != "lora" {
        return Err(format!(
            "adapter `{name}` is not a LoRA: its adapter.type is `{kind}`, not `lora`"
        ));
    }
    let theirs = adapter.architecture().unwrap_or("");
    if theirs != arch {
        return Err(format!(
            "adapter `{name}` was made for architecture `{theirs}` (general.architecture), \
             the model is `{arch}`"
        ));
    }
    // Each target's pair, in name order so the message names the same tensor every time.
    type Pair<'a> = (Option<&'a TensorInfo>, Option<&'a TensorInfo>);
    let mut pairs: BTreeMap<&str, Pair<'_>> = BTreeMap::new();
    for t in &adapter.tensors {
        if let Some(target) = t.name.strip_suffix(".lora_a") {
            pairs.entry(target).or_default().0 = Some(t);
        } else if let Some(target) = t.name.strip_suffix(".lora_b") {
            pairs.entry(target).or_default().1 = Some(t);
        } else if !t.name.ends_with("_norm.weight") {
            // llama.cpp skips norm vectors and refuses anything else.
            return Err(format!(
                "adapter `{name}`: tensor `{}` is neither a lora_a nor a lora_b",
                t.name
            ));
        }
    }
    if pairs.is_empty() {
        return Err(format!("adapter `{name}` holds no LoRA tensors"));
    }
    let misfits: Vec<String> = pairs
        .iter()
        .filter_map(|(target, pair)| match pair {
            (Some(a), Some(b)) => match base.get(*target) {
                None => Some(format!(
                    "`{target}.lora_a` targets `{target}`, which the model does not have"
                )),
                Some(dims) => pair_misfit(target, &a.dims, &b.dims, dims),
            },
            (Some(_), None) => Some(format!("`{target}.lora_a` has no `{target}.lora_b`")),
            (None, _) => Some(format!("`{target}.lora_b` has no `{target}.lora_a`")),
        })
        .collect();
    match misfits.as_slice() {
        [] => Ok(()),
        [one] => Err(format!("adapter `{name}` does not fit the model: {one}")),
        [first, rest @ ..] => Err(format!(
            "adapter `{name}` does not fit the model: {first} (and {} more tensor pairs do not fit)",
            rest.len()
        )),
    }
}

/// The base model's tensor shapes by name, from its GGUF header (read on the first adapter
/// load, then kept).
pub(crate) fn read_base_tensors(
    path: &std::path::Path,
) -> Result<HashMap<String, Vec<u64>>, String> {
    let header = gguf_info::read(path).map_err(|e| {
        format!(
            "cannot read the model's tensors from {}: {e}",
            path.display()
        )
    })?;
    Ok(header
        .tensors
        .into_iter()
        .map(|t| (t.name, t.dims))
        .collect())
}

impl LlamaLoaded {
    /// ABI 1.6 `adapter_load`: check `desc`'s GGUF LoRA against the model, then load it.
    pub(crate) fn load_adapter(
        &self,
        desc: &AdapterDescriptor,
    ) -> Result<LoadedAdapter, EngineError> {
        let name = &desc.name;
        if desc.format == Format::Safetensors {
            return Err(EngineError::unsupported(format!(
                "adapter `{name}`: the llama.cpp engine reads GGUF LoRA adapters; convert a PEFT \
                 adapter with llama.cpp's convert_lora_to_gguf.py"
            )));
        }
        if !desc.scale.is_finite() {
            return Err(EngineError::unsupported(format!(
                "adapter `{name}`: scale {} is not a finite number",
                desc.scale
            )));
        }
        let corrupt = |why: String| {
            EngineError::new(
                Status::ModelCorrupt,
                format!("adapter `{name}`: {} {why}", desc.path.display()),
            )
        };
        let header = gguf_info::read(&desc.path)
            .map_err(|e| corrupt(format!("is not a readable GGUF file: {e}")))?;
        let file_len = std::fs::metadata(&desc.path)
            .map_err(|e| corrupt(format!("cannot be read: {e}")))?
            .len();
        let base = self
            .base_tensors
            .get_or_init(|| read_base_tensors(&self.path))
            .as_ref()
            .map_err(|e| EngineError::internal(e.clone()))?;
        check_fit(name, &header, &self.info.architecture, base)
            .map_err(|m| EngineError::new(Status::LoadFailed, m))?;
        let path = CString::new(desc.path.as_os_str().as_encoded_bytes())
            .map_err(|_| corrupt("has a NUL byte in its path".into()))?;

        // The model's adapter list changes: no step may read it meanwhile.
        let mut ex = self.exec();
        let (raw, errors) = logging::capture_errors(|| {
            // SAFETY: the model is alive (it outlives `self`), the path is a NUL-terminated
            // string valid for the call, and the exec lock keeps every decode (which reads the
            // model's adapter list) out while llama.cpp adds to it.
            unsafe {
                llama_cpp_sys_2::llama_adapter_lora_init(raw_model(self.model), path.as_ptr())
            }
        });
        let raw = NonNull::new(raw).ok_or_else(|| {
            let why = if errors.is_empty() {
                "no reason logged".to_string()
            } else {
                errors.join("; ")
            };
            let message = format!("llama.cpp refused adapter `{name}`: {why}");
            // llama.cpp says why only in its log; this line is its buffer allocation failing
            // (`llama_adapter_lora_init_impl`), which the host handles as memory pressure.
            if why.contains("failed to allocate buffer for lora adapter") {
                oom(message)
            } else {
                EngineError::new(Status::LoadFailed, message)
            }
        })?;
        let id = ex.next_adapter;
        ex.next_adapter += 1;
        ex.adapters.insert(
            id,
            LoraAdapter {
                raw,
                scale: desc.scale,
                name: name.clone(),
            },
        );
        logging::debug(&format!("adapter `{name}` loaded as {id}"));
        // What the file's tensors take (llama.cpp copies them as they are).
        let bytes = file_len.saturating_sub(header.data_offset);
        Ok(LoadedAdapter { id, bytes })
    }
}

impl Exec {
    /// Make the context run `adapter` (0 = the base model) from its next decode on.
    pub(crate) fn use_adapter(&mut self, adapter: u64) -> Result<(), EngineError> {
        if adapter == self.active_adapter {
            return Ok(());
        }
        let result = if adapter == 0 {
            // llama-cpp-2's remove clears every adapter of the context; it only wants one to
            // name, and the active one is still loaded (unloading clears it first).
            let active = self.adapters.get(&self.active_adapter).ok_or_else(|| {
                EngineError::internal(format!("adapter {} vanished", self.active_adapter))
            })?;
            self.ctx
                .lora_adapter_remove(&mut active.wrapper())
                .map_err(|e| e.to_string())
        } else {
            let a = self
                .adapters
                .get(&adapter)
                .ok_or_else(|| EngineError::internal(format!("no adapter {adapter} is loaded")))?;
            self.ctx
                .lora_adapter_set(&mut a.wrapper(), a.scale)
                .map_err(|e| e.to_string())
        };
        result.map_err(|e| EngineError::internal(format!("setting adapter {adapter}: {e}")))?;
        self.active_adapter = adapter;
        Ok(())
    }

    /// ABI 1.6 `seq_set_adapter`: `seq` runs `adapter` from its first step on.
    pub(crate) fn set_seq_adapter(&mut self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        if adapter != 0 && !self.adapters.contains_key(&adapter) {
            return Err(EngineError::internal(format!(
                "sequence {seq}: no adapter {adapter} is loaded"
            )));
        }
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| EngineError::internal(format!("unknown sequence {seq}")))?;
        if s.adapter != adapter && s.slot.is_some() {
            // Its KV was computed under the other adapter.
            return Err(EngineError::internal(format!(
                "sequence {seq} has been stepped with adapter {}: its adapter is set before its \
                 first step",
                s.adapter
            )));
        }
        s.adapter = adapter;
        Ok(())
    }

    /// ABI 1.6 `adapter_unload`. The host releases the adapter's sequences first; one still
    /// open keeps the adapter (logged), an unknown id is nothing to do.
    pub(crate) fn unload_adapter(&mut self, adapter: u64) {
        let Some(name) = self.adapters.get(&adapter).map(|a| a.name.clone()) else {
            return;
        };
        let open = self.seqs.values().filter(|s| s.adapter == adapter).count();
        if open > 0 {
            logging::warn(&format!(
                "adapter `{name}` ({adapter}) not unloaded: {open} open sequences run it"
            ));
            return;
        }
        if self.active_adapter == adapter
            && let Err(e) = self.use_adapter(0)
        {
            logging::warn(&format!("adapter `{name}` not unloaded: {e}"));
            return;
        }
        // Warm cells computed under it can serve no one now (ids are never reused).
        for f in &mut self.free_slots {
            if f.adapter == adapter && !f.tokens.is_empty() {
                let _ = self.ctx.clear_kv_cache_seq(Some(f.id as u32), None, None);
                f.tokens.clear();
            }
        }
        self.adapters.remove(&adapter);
        logging::debug(&format!("adapter `{name}` ({adapter}) unloaded"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, dims: &[u64]) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dims: dims.to_vec(),
        }
    }

    fn lora(arch: &str, tensors: Vec<TensorInfo>) -> GgufInfo {
        let mut h = GgufInfo {
            tensors,
            ..GgufInfo::default()
        };
        for (k, v) in [
            ("general.type", "adapter"),
            ("adapter.type", "lora"),
            ("general.architecture", arch),
        ] {
            h.metadata.insert(k.into(), v.into());
        }
        h
    }

    /// Two layers of a small llama: q is [576, 576], k [576, 192], the embedding [576, 1000].
    fn base() -> HashMap<String, Vec<u64>> {
        let mut m = HashMap::new();
        for l in 0..2 {
            m.insert(format!("blk.{l}.attn_q.weight"), vec![576, 576]);
            m.insert(format!("blk.{l}.attn_k.weight"), vec![576, 192]);
        }
        m.insert("token_embd.weight".into(), vec![576, 1000]);
        m
    }

    fn good() -> Vec<TensorInfo> {
        (0..2)
            .flat_map(|l| {
                [
                    tensor(&format!("blk.{l}.attn_q.weight.lora_a"), &[576, 8]),
                    tensor(&format!("blk.{l}.attn_q.weight.lora_b"), &[8, 576]),
                    tensor(&format!("blk.{l}.attn_k.weight.lora_a"), &[576, 8]),
                    tensor(&format!("blk.{l}.attn_k.weight.lora_b"), &[8, 192]),
                ]
            })
            .chain([
                tensor("token_embd.weight.lora_a", &[8, 1000]),
                tensor("token_embd.weight.lora_b", &[8, 576]),
                tensor("blk.0.attn_norm.weight", &[576]),
            ])
            .collect()
    }

    #[test]
    fn an_adapter_whose_pairs_fit_their_base_tensors_is_accepted() {
        assert_eq!(
            check_fit("p", &lora("llama", good()), "llama", &base()),
            Ok(())
        );
    }

    #[test]
    fn another_architecture_is_refused_naming_both() {
        let e = check_fit("p", &lora("gemma3", good()), "llama", &base()).expect_err("refused");
        assert!(e.contains("`gemma3`") && e.contains("`llama`"), "{e}");
    }

    #[test]
    fn a_wrong_input_size_names_the_tensor_and_both_shapes_and_counts_the_rest() {
        let mut t = good();
        for x in &mut t {
            if x.name.ends_with("attn_q.weight.lora_a") {
                x.dims = vec![512, 8];
            }
        }
        let e = check_fit("bad", &lora("llama", t), "llama", &base()).expect_err("refused");
        assert!(
            e.contains("`blk.0.attn_q.weight.lora_a` is [512, 8]")
                && e.contains("`blk.0.attn_q.weight` [576, 576]")
                && e.contains("input size 576")
                && e.contains("and 1 more"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_target_a_lone_half_a_zero_rank_and_a_stray_tensor_are_refused() {
        let refused = |t: Vec<TensorInfo>, want: &str| {
            let e = check_fit("x", &lora("llama", t), "llama", &base()).expect_err(want);
            assert!(e.contains(want), "{e} lacks {want}");
        };
        let mut t = good();
        t.push(tensor("blk.0.attn_qkv.weight.lora_a", &[576, 8]));
        t.push(tensor("blk.0.attn_qkv.weight.lora_b", &[8, 1728]));
        refused(t, "`blk.0.attn_qkv.weight`, which the model does not have");
        let mut t = good();
        t.retain(|x| x.name != "blk.1.attn_k.weight.lora_b");
        refused(
            t,
            "`blk.1.attn_k.weight.lora_a` has no `blk.1.attn_k.weight.lora_b`",
        );
        let t = vec![
            tensor("blk.0.attn_q.weight.lora_a", &[576, 0]),
            tensor("blk.0.attn_q.weight.lora_b", &[0, 576]),
        ];
        refused(t, "its rank is 0");
        let t = vec![
            tensor("blk.0.attn_q.weight.lora_a", &[576, 8]),
            tensor("blk.0.attn_q.weight.lora_b", &[4, 576]),
        ];
        refused(t, "the two ranks differ (8, 4)");
        let mut t = good();
        t.push(tensor("blk.0.attn_q.weight", &[576, 576]));
        refused(t, "neither a lora_a nor a lora_b");
        refused(Vec::new(), "holds no LoRA tensors");
    }

    #[test]
    fn a_model_file_is_not_an_adapter() {
        let mut h = lora("llama", good());
        h.metadata.insert("general.type".into(), "model".into());
        let e = check_fit("m", &h, "llama", &base()).expect_err("refused");
        assert!(e.contains("general.type is `model`"), "{e}");
    }
}
