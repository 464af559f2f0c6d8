//! Engine host, model calls (the scheduler's `step` and the tokenizer's calls land here): a
//! loaded model's handle, split in two to encode the header's threading rules.
//!
//! [`ModelShared`] (`info`/`tokenize`/`detokenize`) may be called from any
//! thread; [`ModelExec`] (`seq_*`/`step`/`embed`) is owned by one scheduler
//! and takes `&mut self`. The plugin's `unload_model` runs when the last of
//! the two is dropped. For a plugin in `process` isolation both forward to the model's
//! worker process (`worker/client.rs`), which is killed when the last of the two is dropped.

use std::sync::Arc;

use gantry_engine_abi::ffi;
use gantry_engine_abi::{EngineError, EngineInfo, ModelInfo, SampledToken, StepEntry};

use super::{PluginInner, fill_growing, new_err, opt_string, read_err};
use crate::worker::{Crash, RemoteExec, RemoteModel, Worker};

/// Where a model's calls go: into the plugin in this process, or to its worker.
pub(super) enum Handle {
    Local(Arc<ModelHandle>),
    Remote {
        model: Arc<RemoteModel>,
        plugin: Arc<EngineInfo>,
    },
}

/// Where a model's exec calls go.
pub(super) enum Exec {
    Local(Arc<ModelHandle>),
    Remote(RemoteExec),
}

/// The raw model handle; unloads when the last of shared/exec is dropped.
pub(super) struct ModelHandle {
    pub(super) plugin: Arc<PluginInner>,
    pub(super) raw: *mut ffi::gantry_model_t,
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
            })
        }
    }
}

/// Calls on a model that any thread may make at any time.
pub struct ModelShared {
    pub(super) handle: Handle,
    pub(super) info: ModelInfo,
}

impl std::fmt::Debug for ModelShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelShared")
            .field("info", &self.info)
            .finish()
    }
}

impl ModelShared {
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn plugin_info(&self) -> &EngineInfo {
        match &self.handle {
            Handle::Local(h) => &h.plugin.info,
            Handle::Remote { plugin, .. } => plugin,
        }
    }

    pub fn plugin_id(&self) -> &str {
        &self.plugin_info().engine_id
    }

    /// Whether the plugin applies allowed-token masks (`GANTRY_CAP_TOKEN_MASK`, ABI 1.2).
    pub fn supports_token_mask(&self) -> bool {
        self.plugin_info().supports_token_mask()
    }

    /// The worker process serving this model (`process` isolation).
    pub fn worker_pid(&self) -> Option<u32> {
        match &self.handle {
            Handle::Local(_) => None,
            Handle::Remote { model, .. } => Some(model.worker.pid()),
        }
    }

    /// Each token's bytes on its own (a vocabulary): one call per token in-process, one
    /// round trip for all of them to a worker.
    pub fn detokenize_each(
        &self,
        tokens: &[i32],
        render_special: bool,
    ) -> Result<Vec<Vec<u8>>, EngineError> {
        match &self.handle {
            Handle::Local(_) => tokens
                .iter()
                .map(|t| self.detokenize(&[*t], render_special))
                .collect(),
            Handle::Remote { model, .. } => model.detokenize_each(tokens, render_special),
        }
    }

    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        let h = match &self.handle {
            Handle::Local(h) => h,
            Handle::Remote { model, .. } => {
                return model.tokenize(text, add_special, parse_special);
            }
        };
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

    /// Raw bytes of `tokens`; may end inside a UTF-8 character.
    pub fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        let h = match &self.handle {
            Handle::Local(h) => h,
            Handle::Remote { model, .. } => return model.detokenize(tokens, render_special),
        };
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

/// Calls that only the model's scheduler makes (never concurrently).
pub struct ModelExec {
    pub(super) exec: Exec,
    pub(super) shared: Arc<ModelShared>,
}

impl std::fmt::Debug for ModelExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelExec")
            .field("model", &self.shared.info.architecture)
            .finish()
    }
}

impl ModelExec {
    pub fn shared(&self) -> &Arc<ModelShared> {
        &self.shared
    }

    /// The worker crash that ended this model, if it runs in one that crashed.
    pub fn crashed(&self) -> Option<Crash> {
        match &self.exec {
            Exec::Local(_) => None,
            Exec::Remote(r) => r.worker().crash(),
        }
    }

    /// Its worker, which the watchdog may kill (`process` isolation).
    pub fn worker(&self) -> Option<Arc<Worker>> {
        match &self.exec {
            Exec::Local(_) => None,
            Exec::Remote(r) => Some(r.worker().clone()),
        }
    }

    pub fn seq_open(&mut self) -> Result<u64, EngineError> {
        let h = match &mut self.exec {
            Exec::Local(h) => h,
            Exec::Remote(r) => return r.seq_open(),
        };
        let mut seq = 0u64;
        let mut err = new_err();
        // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
        let status = unsafe { (h.plugin.vt.seq_open)(h.raw, &mut seq, err.as_mut()) };
        if status != ffi::GANTRY_OK {
            return Err(read_err(status, &err));
        }
        Ok(seq)
    }

    pub fn seq_release(&mut self, seq: u64) {
        let h = match &mut self.exec {
            Exec::Local(h) => h,
            Exec::Remote(r) => return r.seq_release(seq),
        };
        // SAFETY: live handle; unknown ids are a no-op by contract.
        unsafe { (h.plugin.vt.seq_release)(h.raw, seq) };
    }

    /// One forward pass; see the header's `step`.
    pub fn step(
        &mut self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let h = match &mut self.exec {
            Exec::Local(h) => h,
            Exec::Remote(r) => return r.step(entries),
        };
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
                }) | (if e.fresh { ffi::GANTRY_STEP_FRESH } else { 0 }),
                sampling: s.as_ref().map_or(std::ptr::null(), std::ptr::from_ref),
            })
            .collect();
        let mut results = vec![ffi::gantry_step_result_t::default(); raw.len()];
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
        Ok(results
            .into_iter()
            .zip(entries)
            .map(|(r, e)| {
                e.sample.map(|_| SampledToken {
                    token: r.token,
                    logprob: r.logprob,
                    top: r.top[..(r.n_top as usize).min(ffi::GANTRY_MAX_TOP_LOGPROBS)]
                        .iter()
                        .map(|t| (t.token, t.logprob))
                        .collect(),
                })
            })
            .collect())
    }

    /// How many tokens of `seq`'s first entry the engine took from its cache (ABI 1.4); `None`
    /// when the plugin does not report it (older than 1.4, or it does not know). Asked after
    /// the step that carried the first entry.
    pub fn seq_cached_tokens(&mut self, seq: u64) -> Option<u64> {
        let h = match &mut self.exec {
            Exec::Local(h) => h,
            Exec::Remote(r) => return r.seq_cached_tokens(seq),
        };
        let f = h.plugin.vt.seq_cached_tokens?;
        // SAFETY: live handle; `&mut self` keeps exec calls exclusive.
        let n = unsafe { f(h.raw, seq) };
        u64::try_from(n).ok()
    }

    pub fn embed(&mut self, tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        let dims = self.shared.info.embedding_dims as usize;
        let h = match &mut self.exec {
            Exec::Local(h) => h,
            Exec::Remote(r) => return r.embed(tokens),
        };
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
