//! Engine host, in-process model calls (call boundary: the scheduler's step and the
//! tokenizer's calls land here for a plugin in this process): a loaded model's raw handle and
//! the vtable calls on it, the in-process implementation of `model.rs`'s call traits.

use std::sync::Arc;

use gantry_engine_abi::ffi;
use gantry_engine_abi::{
    AdapterDescriptor, EngineError, EngineInfo, Input, LoadedAdapter, ModelDescriptor, ModelInfo,
    SampledToken, SpeechPiece, SpeechRequest, StepEntry,
};

use super::library::{
    PluginInner, cstring, fill_growing, new_err, opt_string, path_cstring, read_err,
};
use crate::model::{ExecCalls, SharedCalls};

mod media;

/// Load a model into the plugin (the caller holds the plugin's load lock).
pub(super) fn load(
    inner: &Arc<PluginInner>,
    desc: &ModelDescriptor,
) -> Result<Arc<ModelHandle>, EngineError> {
    let id = cstring(&desc.model_id);
    let dir = path_cstring(&desc.model_dir);
    let primary = path_cstring(&desc.primary_file);
    let quant = desc.quantization.as_deref().map(cstring);
    let mmproj = desc.mmproj.as_deref().map(path_cstring);
    let raw = ffi::gantry_model_desc_t {
        struct_size: size_of::<ffi::gantry_model_desc_t>() as u32,
        model_id: id.as_ptr(),
        model_dir: dir.as_ptr(),
        primary_file: primary.as_ptr(),
        format: desc.format.as_raw(),
        quantization: quant.as_ref().map_or(std::ptr::null(), |q| q.as_ptr()),
        mmproj: mmproj.as_ref().map_or(std::ptr::null(), |m| m.as_ptr()),
        context_length: desc.context_length,
        max_sequences: desc.max_sequences,
        device_ids: if desc.device_ids.is_empty() {
            std::ptr::null()
        } else {
            desc.device_ids.as_ptr()
        },
        n_device_ids: desc.device_ids.len(),
        n_threads: desc.n_threads,
    };
    let mut handle: *mut ffi::gantry_model_t = std::ptr::null_mut();
    let mut err = new_err();
    // SAFETY: `raw`'s strings outlive the call; the engine is alive.
    let status = unsafe { (inner.vt.load_model)(inner.engine, &raw, &mut handle, err.as_mut()) };
    if status != ffi::GANTRY_OK || handle.is_null() {
        return Err(read_err(status, &err));
    }
    let handle = Arc::new(ModelHandle {
        plugin: inner.clone(),
        raw: handle,
    });
    Ok(handle)
}

/// The raw model handle; unloads when the last of shared/exec is dropped.
pub(super) struct ModelHandle {
    plugin: Arc<PluginInner>,
    raw: *mut ffi::gantry_model_t,
}

// SAFETY: the header allows model_info/tokenize/detokenize from any thread
// concurrently; exec calls are funnelled through the single `ModelExec`.
unsafe impl Send for ModelHandle {}
// SAFETY: as above.
unsafe impl Sync for ModelHandle {}

impl Drop for ModelHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from load_model and is released exactly once.
        unsafe { (self.plugin.vt.unload_model)(self.raw) };
    }
}

impl ModelHandle {
    pub(super) fn read_info(&self) -> Result<ModelInfo, EngineError> {
        // SAFETY: zeroed is a valid bit pattern for this plain C struct
        // (null pointers, zero numbers, false).
        let mut raw: ffi::gantry_model_info_t = unsafe { std::mem::zeroed() };
        raw.struct_size = size_of::<ffi::gantry_model_info_t>() as u32;
        let mut err = new_err();
        // SAFETY: live handle, host-allocated out struct.
        let status = unsafe { (self.plugin.vt.model_info)(self.raw, &mut raw, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        let tok = |t: i32| (t >= 0).then_some(t);
        // SAFETY: strings and arrays are owned by the model, valid until unload;
        // we copy them out now.
        unsafe {
            let eog = if raw.eog_tokens.is_null() || raw.n_eog_tokens == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(raw.eog_tokens, raw.n_eog_tokens).to_vec()
            };
            Ok(ModelInfo {
                architecture: opt_string(raw.architecture).unwrap_or_default(),
                vocab_size: raw.vocab_size,
                context_length: raw.context_length,
                trained_context_length: raw.trained_context_length,
                kv_capacity_tokens: raw.kv_capacity_tokens,
                max_sequences: raw.max_sequences,
                bos_token: tok(raw.bos_token),
                eos_token: tok(raw.eos_token),
                eog_tokens: eog,
                bos_text: opt_string(raw.bos_text),
                eos_text: opt_string(raw.eos_text),
                chat_template: opt_string(raw.chat_template),
                bytes_used: raw.bytes_used,
                modalities: raw.modalities,
                embedding_dims: raw.embedding_dims,
                add_bos: raw.add_bos,
                // Zero from a plugin older than 1.7 (it writes less of the zeroed struct).
                recurrent_state_bytes: raw.recurrent_state_bytes,
                // Zero from a plugin older than 1.9.
                audio_sample_rate: raw.audio_sample_rate,
                audio_max_samples: raw.audio_max_samples,
                // Null from a plugin older than 1.10.
                voices: opt_string(raw.voices)
                    .map(|v| v.split('\n').map(str::to_owned).collect())
                    .unwrap_or_default(),
            })
        }
    }
}

/// A model in this process: both call groups go to its handle, which the header's rules allow
/// (the shared calls from any thread; the exec calls from the one `ModelExec`).
pub(super) struct LocalModel(pub(super) Arc<ModelHandle>);

impl SharedCalls for LocalModel {
    fn plugin(&self) -> &EngineInfo {
        &self.0.plugin.info
    }

    fn worker_pid(&self) -> Option<u32> {
        None
    }

    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        let h = &self.0;
        // Most text is at most one token per byte, plus BOS.
        fill_growing("tokenize", text.len() + 8, |buf: &mut [i32], n, err| {
            // SAFETY: `text` and `buf` are valid for the lengths given.
            unsafe {
                (h.plugin.vt.tokenize)(
                    h.raw,
                    text.as_ptr().cast(),
                    text.len(),
                    add_special,
                    parse_special,
                    buf.as_mut_ptr(),
                    buf.len(),
                    n,
                    err,
                )
            }
        })
    }

    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        let h = &self.0;
        fill_growing(
            "detokenize",
            tokens.len() * 16 + 16,
            |buf: &mut [u8], n, err| {
                // SAFETY: `tokens` and `buf` are valid for the lengths given.
                unsafe {
                    (h.plugin.vt.detokenize)(
                        h.raw,
                        tokens.as_ptr(),
                        tokens.len(),
                        render_special,
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        n,
                        err,
                    )
                }
            },
        )
    }
}

impl ExecCalls for LocalModel {
    fn seq_open(&mut self) -> Result<u64, EngineError> {
        let h = &self.0;
        let mut seq = 0u64;
        let mut err = new_err();
        // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
        let status = unsafe { (h.plugin.vt.seq_open)(h.raw, &mut seq, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        Ok(seq)
    }

    fn seq_release(&mut self, seq: u64) {
        let h = &self.0;
        // SAFETY: live handle; unknown ids are a no-op by contract.
        unsafe { (h.plugin.vt.seq_release)(h.raw, seq) };
    }

    fn step(
        &mut self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let h = &self.0;
        // The C views borrow from these vectors, which outlive the call.
        let biases: Vec<Vec<ffi::gantry_logit_bias_t>> = entries
            .iter()
            .map(|e| {
                e.sample.map_or_else(Vec::new, |s| {
                    s.logit_bias
                        .iter()
                        .map(|&(token, bias)| ffi::gantry_logit_bias_t { token, bias })
                        .collect()
                })
            })
            .collect();
        let samplings: Vec<Option<ffi::gantry_sampling_t>> = entries
            .iter()
            .zip(&biases)
            .map(|(e, b)| {
                e.sample.map(|s| ffi::gantry_sampling_t {
                    struct_size: size_of::<ffi::gantry_sampling_t>() as u32,
                    temperature: s.temperature,
                    top_p: s.top_p,
                    top_k: s.top_k,
                    min_p: s.min_p,
                    repetition_penalty: s.repetition_penalty,
                    presence_penalty: s.presence_penalty,
                    frequency_penalty: s.frequency_penalty,
                    penalty_last_n: s.penalty_last_n,
                    seed: s.seed,
                    logit_bias: if b.is_empty() {
                        std::ptr::null()
                    } else {
                        b.as_ptr()
                    },
                    n_logit_bias: b.len(),
                    top_logprobs: s.top_logprobs.min(ffi::GANTRY_MAX_TOP_LOGPROBS as u32),
                    want_logprob: s.want_logprob,
                    allowed_tokens: e.allowed.map_or(std::ptr::null(), <[u32]>::as_ptr),
                    n_allowed_words: e.allowed.map_or(0, <[u32]>::len),
                })
            })
            .collect();
        let raw: Vec<ffi::gantry_step_entry_t> = entries
            .iter()
            .zip(&samplings)
            .map(|(e, s)| ffi::gantry_step_entry_t {
                seq: e.seq,
                tokens: e.tokens.as_ptr(),
                n_tokens: e.tokens.len(),
                flags: (if s.is_some() {
                    ffi::GANTRY_STEP_SAMPLE
                } else {
                    0
                }) | (if e.fresh { ffi::GANTRY_STEP_FRESH } else { 0 })
                    | (if e.verifies() {
                        ffi::GANTRY_STEP_SAMPLE_ALL
                    } else {
                        0
                    }),
                sampling: s.as_ref().map_or(std::ptr::null(), std::ptr::from_ref),
            })
            .collect();
        let slots: usize = entries.iter().map(StepEntry::result_slots).sum();
        let mut results = vec![ffi::gantry_step_result_t::default(); slots];
        let mut err = new_err();
        // SAFETY: `raw`, `samplings`, `biases` and `results` are valid and
        // outlive the call; `&mut self` keeps exec calls exclusive.
        let status = unsafe {
            (h.plugin.vt.step)(
                h.raw,
                raw.as_ptr(),
                raw.len(),
                results.as_mut_ptr(),
                err.as_mut(),
            )
        };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        let mut results = results.into_iter();
        let mut out = Vec::with_capacity(slots);
        for e in entries {
            for r in results.by_ref().take(e.result_slots()) {
                out.push(e.sample.map(|_| {
                    SampledToken {
                        token: r.token,
                        logprob: r.logprob,
                        top: r.top[..(r.n_top as usize).min(ffi::GANTRY_MAX_TOP_LOGPROBS)]
                            .iter()
                            .map(|t| (t.token, t.logprob))
                            .collect(),
                    }
                }));
            }
        }
        Ok(out)
    }

    fn seq_fork(&mut self, src: u64) -> Result<u64, EngineError> {
        let h = &self.0;
        let f = h.plugin.vt.seq_fork.ok_or_else(|| {
            EngineError::unsupported("the plugin is older than ABI 1.5 (no seq_fork)")
        })?;
        let mut seq = 0u64;
        let mut err = new_err();
        // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
        let status = unsafe { f(h.raw, src, &mut seq, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        Ok(seq)
    }

    fn seq_truncate(&mut self, seq: u64, n_keep: u64) -> Result<(), EngineError> {
        let h = &self.0;
        let f = h.plugin.vt.seq_truncate.ok_or_else(|| {
            EngineError::unsupported("the plugin is older than ABI 1.5 (no seq_truncate)")
        })?;
        let mut err = new_err();
        // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
        let status = unsafe { f(h.raw, seq, n_keep, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        Ok(())
    }

    fn adapter_load(&mut self, desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        let h = &self.0;
        let f = h.plugin.vt.adapter_load.ok_or_else(|| {
            EngineError::unsupported("the plugin is older than ABI 1.6 (no adapter_load)")
        })?;
        let name = cstring(&desc.name);
        let path = path_cstring(&desc.path);
        let c = ffi::gantry_adapter_desc_t {
            struct_size: size_of::<ffi::gantry_adapter_desc_t>() as u32,
            name: name.as_ptr(),
            path: path.as_ptr(),
            format: desc.format.as_raw(),
            scale: desc.scale,
        };
        let (mut id, mut bytes) = (0u64, 0u64);
        let mut err = new_err();
        // SAFETY: live handle; `c` and its strings outlive the call; `&mut self` keeps exec
        // calls exclusive.
        let status = unsafe { f(h.raw, &c, &mut id, &mut bytes, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        if id == 0 {
            return Err(EngineError::internal("adapter_load returned id 0"));
        }
        Ok(LoadedAdapter { id, bytes })
    }

    fn adapter_unload(&mut self, adapter: u64) {
        let h = &self.0;
        if let Some(f) = h.plugin.vt.adapter_unload {
            // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
            unsafe { f(h.raw, adapter) }
        }
    }

    fn seq_set_adapter(&mut self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        let h = &self.0;
        let f = h.plugin.vt.seq_set_adapter.ok_or_else(|| {
            EngineError::unsupported("the plugin is older than ABI 1.6 (no seq_set_adapter)")
        })?;
        let mut err = new_err();
        // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
        let status = unsafe { f(h.raw, seq, adapter, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        Ok(())
    }

    fn seq_set_input(&mut self, seq: u64, input: &Input<'_>) -> Result<(), EngineError> {
        media::seq_set_input(self, seq, input)
    }

    fn speech_open(&mut self, req: &SpeechRequest<'_>) -> Result<u64, EngineError> {
        media::speech_open(self, req)
    }

    fn speech_next(&mut self, speech: u64) -> Result<SpeechPiece, EngineError> {
        media::speech_next(self, speech)
    }

    fn seq_token_times(&mut self, seq: u64, first: usize) -> Result<Vec<f32>, EngineError> {
        media::seq_token_times(self, seq, first)
    }

    fn seq_token_prob(&mut self, seq: u64, n_fed: usize, token: i32) -> Result<f32, EngineError> {
        media::seq_token_prob(self, seq, n_fed, token)
    }

    fn counters(&mut self) -> Result<Vec<(String, u64)>, EngineError> {
        let h = &self.0;
        let Some(f) = h.plugin.vt.model_counters else {
            return Ok(Vec::new());
        };
        let mut array: *const ffi::gantry_counter_t = std::ptr::null();
        let mut n = 0usize;
        let mut err = new_err();
        // SAFETY: live handle, host-owned out pointers; `&mut` on the model keeps exec calls
        // exclusive.
        let status = unsafe { f(h.raw, &mut array, &mut n, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        if array.is_null() || n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin keeps `n` counters at `array`, each name NUL-terminated, until
        // its next `model_counters` call (header rule); they are copied out now.
        let counters = unsafe { std::slice::from_raw_parts(array, n) };
        Ok(counters
            .iter()
            .filter(|c| !c.name.is_null())
            .map(|c| {
                // SAFETY: non-null, NUL-terminated (header rule), alive until the next call.
                let name = unsafe { std::ffi::CStr::from_ptr(c.name) };
                (name.to_string_lossy().into_owned(), c.value)
            })
            .collect())
    }

    fn speech_close(&mut self, speech: u64) {
        media::speech_close(self, speech)
    }

    fn seq_cached_tokens(&mut self, seq: u64) -> Option<u64> {
        let h = &self.0;
        let f = h.plugin.vt.seq_cached_tokens?;
        // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
        let n = unsafe { f(h.raw, seq) };
        u64::try_from(n).ok()
    }

    fn embed_batch(
        &mut self,
        inputs: &[Vec<i32>],
        dims: usize,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let h = &self.0;
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let Some(batch) = h.plugin.vt.embed_batch else {
            // A plugin older than ABI 1.8: one call per input, the failing one named where
            // there are several.
            return inputs
                .iter()
                .enumerate()
                .map(|(i, tokens)| {
                    self.embed_one(tokens, dims)
                        .map_err(|e| e.for_input(i, inputs.len()))
                })
                .collect();
        };
        let lengths: Vec<usize> = inputs.iter().map(Vec::len).collect();
        let tokens: Vec<i32> = inputs.concat();
        // The plugin reports one vector's size; the buffer holds every input's.
        let mut dim = dims;
        let flat = fill_growing(
            "embed_batch",
            dims * inputs.len(),
            |out: &mut [f32], n, err| {
                let mut d = 0usize;
                // SAFETY: `tokens` holds the sum of `lengths`, `out` its length in floats;
                // exclusive via &mut self.
                let status = unsafe {
                    batch(
                        h.raw,
                        tokens.as_ptr(),
                        lengths.as_ptr(),
                        lengths.len(),
                        out.as_mut_ptr(),
                        out.len(),
                        &mut d,
                        err,
                    )
                };
                dim = d;
                *n = d.saturating_mul(lengths.len());
                status
            },
        )?;
        if dim == 0 || flat.len() != dim * inputs.len() {
            return Err(EngineError::internal(format!(
                "embed_batch: {} floats for {} inputs of {dim}",
                flat.len(),
                inputs.len()
            )));
        }
        Ok(flat.chunks_exact(dim).map(<[f32]>::to_vec).collect())
    }
}

impl LocalModel {
    /// One input through ABI 1.0's `embed`.
    fn embed_one(&mut self, tokens: &[i32], dims: usize) -> Result<Vec<f32>, EngineError> {
        let h = &self.0;
        fill_growing("embed", dims, |out: &mut [f32], n, err| {
            // SAFETY: buffers valid for the lengths given; exclusive via &mut self.
            unsafe {
                (h.plugin.vt.embed)(
                    h.raw,
                    tokens.as_ptr(),
                    tokens.len(),
                    out.as_mut_ptr(),
                    out.len(),
                    n,
                    err,
                )
            }
        })
    }
}
