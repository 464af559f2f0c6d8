//! Engine host, worker wire format (between `worker/client.rs` in the node and
//! `worker/serve.rs` in `gantry-node engine-worker`): frames on the Unix socket and the
//! binary layout of the per-step data in shared memory.
//!
//! A frame is `u32 length` (little-endian) and that many bytes; a request's first byte is
//! its [`Op`], a reply's first byte is `0` (OK) or an engine status code (the ABI's
//! `gantry_status_t`, as a byte) followed by the error message. Values are little-endian
//! and fixed-width; strings and arrays carry a `u32` count first. The codec is written by
//! hand because the layout is the ABI's own structs, field by field, and a step is encoded
//! in place into the shared mapping with no intermediate allocation: a general
//! serialization crate would add a schema layer and a copy on the per-token path for
//! nothing. No JSON crosses this boundary.

use gantry_engine_abi::{
    Backend, EngineConfig, EngineError, EngineInfo, Format, ModelDescriptor, ModelInfo,
    SampledToken, Sampling, StepEntry,
};

mod codec;
pub use codec::{Reader, Writer, error_reply, read_frame, reply, write_frame};

/// Largest frame either side accepts (a long prompt's tokenize, a vocabulary's pieces).
pub const MAX_FRAME: usize = 256 << 20;

/// What a request asks the worker to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Open the plugin library and create its engine: manifest id, binary path, config.
    Open = 1,
    /// Load the worker's model (one per worker): a model descriptor.
    Load = 2,
    Tokenize = 3,
    Detokenize = 4,
    /// Each token's bytes on its own (a vocabulary in one round trip).
    DetokenizeEach = 5,
    SeqOpen = 6,
    SeqRelease = 7,
    /// The request is in this connection's shared mapping; so is the reply's payload.
    Step = 8,
    SeqCachedTokens = 9,
    /// Inputs (a count, then each one's tokens); the reply is a vector per input.
    Embed = 10,
    /// Map the shared-memory file at this path for this connection's steps.
    MapShm = 11,
    /// ABI 1.5: a source sequence; the reply is the new one.
    SeqFork = 12,
    /// ABI 1.5: a sequence and the tokens it keeps.
    SeqTruncate = 13,
    /// ABI 1.6: name, path, format, scale; the reply is the adapter's id and bytes.
    AdapterLoad = 14,
    /// ABI 1.6: an adapter id.
    AdapterUnload = 15,
    /// ABI 1.6: a sequence and its adapter.
    SeqSetAdapter = 16,
    /// ABI 1.9: a sequence and its input (kind, then audio samples, rate and whether to
    /// align, or image bytes and size).
    SeqSetInput = 17,
    /// ABI 1.10: text, voice (optional), speed; the reply is the speech's handle.
    SpeechOpen = 18,
    /// ABI 1.10: a speech; the reply is its next piece's samples and whether it was the last.
    SpeechNext = 19,
    /// ABI 1.10: a speech to free.
    SpeechClose = 20,
    /// ABI 1.11: a sequence and the first position; the reply is its tokens' times.
    SeqTokenTimes = 21,
    /// ABI 1.11: a sequence, a count of fed tokens and a token; the reply is its probability.
    SeqTokenProb = 22,
    /// ABI 1.12: nothing; the reply is a count, then each counter's name and value.
    ModelCounters = 23,
}

impl Op {
    pub fn from_byte(b: u8) -> Option<Op> {
        use Op::*;
        [
            Open,
            Load,
            Tokenize,
            Detokenize,
            DetokenizeEach,
            SeqOpen,
            SeqRelease,
            Step,
            SeqCachedTokens,
            Embed,
            MapShm,
            SeqFork,
            SeqTruncate,
            AdapterLoad,
            AdapterUnload,
            SeqSetAdapter,
            SeqSetInput,
            SpeechOpen,
            SpeechNext,
            SpeechClose,
            SeqTokenTimes,
            SeqTokenProb,
            ModelCounters,
        ]
        .into_iter()
        .find(|o| *o as u8 == b)
    }
}

/// The reply byte of a plugin that could not be opened: followed by its refusal label and
/// message (an `OpenError`), not an engine status.
pub const OPEN_REFUSED: u8 = 0xFE;

pub fn put_engine_config(w: &mut Writer, c: &EngineConfig) {
    w.u32(c.backend.as_raw())
        .i32s(&c.device_ids)
        .u64(c.vram_limit_bytes)
        .u32(c.n_threads)
        .u32(c.max_batch_size)
        .u32(c.context_length);
}

pub fn get_engine_config(r: &mut Reader<'_>) -> Result<EngineConfig, EngineError> {
    let backend = Backend::from_raw(r.u32()?)
        .ok_or_else(|| EngineError::internal("unknown backend in engine config"))?;
    Ok(EngineConfig {
        backend,
        device_ids: r.i32s()?,
        vram_limit_bytes: r.u64()?,
        n_threads: r.u32()?,
        max_batch_size: r.u32()?,
        context_length: r.u32()?,
    })
}

pub fn put_engine_info(w: &mut Writer, i: &EngineInfo) {
    w.str(&i.engine_id)
        .str(&i.engine_version)
        .u32(i.backend.map_or(u32::MAX, Backend::as_raw))
        .opt_str(i.description.as_deref())
        .u32(i.capabilities)
        .opt_str(i.build_info.as_deref());
}

pub fn get_engine_info(r: &mut Reader<'_>) -> Result<EngineInfo, EngineError> {
    Ok(EngineInfo {
        engine_id: r.string()?,
        engine_version: r.string()?,
        backend: Backend::from_raw(r.u32()?),
        description: r.opt_string()?,
        capabilities: r.u32()?,
        build_info: r.opt_string()?,
    })
}

fn path_str(p: &std::path::Path) -> String {
    p.to_string_lossy().into_owned()
}

pub fn put_descriptor(w: &mut Writer, d: &ModelDescriptor) {
    w.str(&d.model_id)
        .str(&path_str(&d.model_dir))
        .str(&path_str(&d.primary_file))
        .u32(d.format.as_raw())
        .opt_str(d.quantization.as_deref())
        .opt_str(d.mmproj.as_deref().map(path_str).as_deref())
        .u32(d.context_length)
        .u32(d.max_sequences)
        .i32s(&d.device_ids)
        .u32(d.n_threads);
}

pub fn get_descriptor(r: &mut Reader<'_>) -> Result<ModelDescriptor, EngineError> {
    Ok(ModelDescriptor {
        model_id: r.string()?,
        model_dir: r.string()?.into(),
        primary_file: r.string()?.into(),
        format: Format::from_raw(r.u32()?)
            .ok_or_else(|| EngineError::internal("unknown format in model descriptor"))?,
        quantization: r.opt_string()?,
        mmproj: r.opt_string()?.map(Into::into),
        context_length: r.u32()?,
        max_sequences: r.u32()?,
        device_ids: r.i32s()?,
        n_threads: r.u32()?,
    })
}

pub fn put_model_info(w: &mut Writer, i: &ModelInfo) {
    w.str(&i.architecture)
        .u32(i.vocab_size)
        .u32(i.context_length)
        .u32(i.trained_context_length)
        .u64(i.kv_capacity_tokens)
        .u32(i.max_sequences)
        .i32(i.bos_token.unwrap_or(-1))
        .i32(i.eos_token.unwrap_or(-1))
        .i32s(&i.eog_tokens)
        .opt_str(i.bos_text.as_deref())
        .opt_str(i.eos_text.as_deref())
        .opt_str(i.chat_template.as_deref())
        .u64(i.bytes_used)
        .u32(i.modalities)
        .u32(i.embedding_dims)
        .bool(i.add_bos)
        .u64(i.recurrent_state_bytes)
        .u32(i.audio_sample_rate)
        .u64(i.audio_max_samples)
        .str(&i.voices.join("\n"));
}

pub fn get_model_info(r: &mut Reader<'_>) -> Result<ModelInfo, EngineError> {
    let tok = |t: i32| (t >= 0).then_some(t);
    Ok(ModelInfo {
        architecture: r.string()?,
        vocab_size: r.u32()?,
        context_length: r.u32()?,
        trained_context_length: r.u32()?,
        kv_capacity_tokens: r.u64()?,
        max_sequences: r.u32()?,
        bos_token: tok(r.i32()?),
        eos_token: tok(r.i32()?),
        eog_tokens: r.i32s()?,
        bos_text: r.opt_string()?,
        eos_text: r.opt_string()?,
        chat_template: r.opt_string()?,
        bytes_used: r.u64()?,
        modalities: r.u32()?,
        embedding_dims: r.u32()?,
        add_bos: r.bool()?,
        recurrent_state_bytes: r.u64()?,
        audio_sample_rate: r.u32()?,
        audio_max_samples: r.u64()?,
        voices: match r.string()? {
            v if v.is_empty() => Vec::new(),
            v => v.split('\n').map(str::to_owned).collect(),
        },
    })
}

/// Bytes a step request of these entries takes, at most (to size the shared mapping).
pub fn step_request_size(entries: &[StepEntry<'_>]) -> usize {
    4 + entries
        .iter()
        .map(|e| {
            8 + 1
                + 4
                + 4 * e.tokens.len()
                + e.sample.map_or(0, |s| 64 + 8 * s.logit_bias.len())
                + 4
                + 4 * e.allowed.map_or(0, <[u32]>::len)
        })
        .sum::<usize>()
}

/// Bytes a step reply for these entries takes, at most.
pub fn step_reply_size(entries: &[StepEntry<'_>]) -> usize {
    let n: usize = entries.iter().map(StepEntry::result_slots).sum();
    4 + n * (1 + 4 + 4 + 4 + 8 * gantry_engine_abi::ffi::GANTRY_MAX_TOP_LOGPROBS)
}

const F_SAMPLE: u8 = 1;
const F_FRESH: u8 = 2;
const F_ALLOWED: u8 = 4;
const F_SAMPLE_ALL: u8 = 8;

/// Encode a step's entries (the host side).
pub fn put_step(w: &mut Writer, entries: &[StepEntry<'_>]) {
    w.len(entries.len());
    for e in entries {
        let mut flags = 0;
        if e.sample.is_some() {
            flags |= F_SAMPLE;
        }
        if e.fresh {
            flags |= F_FRESH;
        }
        if e.allowed.is_some() {
            flags |= F_ALLOWED;
        }
        if e.sample_all {
            flags |= F_SAMPLE_ALL;
        }
        w.u64(e.seq).u8(flags).i32s(e.tokens);
        if let Some(s) = e.sample {
            w.f32(s.temperature)
                .f32(s.top_p)
                .i32(s.top_k)
                .f32(s.min_p)
                .f32(s.repetition_penalty)
                .f32(s.presence_penalty)
                .f32(s.frequency_penalty)
                .i32(s.penalty_last_n)
                .u64(s.seed)
                .u32(s.top_logprobs)
                .bool(s.want_logprob)
                .len(s.logit_bias.len());
            for (t, b) in &s.logit_bias {
                w.i32(*t).f32(*b);
            }
        }
        if let Some(a) = e.allowed {
            w.u32s(a);
        }
    }
}

/// A decoded step entry (the worker side), owning its arrays.
pub struct OwnedEntry {
    pub seq: u64,
    pub tokens: Vec<i32>,
    pub sample: Option<Sampling>,
    pub fresh: bool,
    pub allowed: Option<Vec<u32>>,
    pub sample_all: bool,
}

impl OwnedEntry {
    pub fn view(&self) -> StepEntry<'_> {
        StepEntry {
            seq: self.seq,
            tokens: &self.tokens,
            sample: self.sample.as_ref(),
            fresh: self.fresh,
            allowed: self.allowed.as_deref(),
            sample_all: self.sample_all,
        }
    }
}

pub fn get_step(r: &mut Reader<'_>) -> Result<Vec<OwnedEntry>, EngineError> {
    let n = r.count(13)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let seq = r.u64()?;
        let flags = r.u8()?;
        let tokens = r.i32s()?;
        let sample = if flags & F_SAMPLE != 0 {
            let mut s = Sampling {
                temperature: r.f32()?,
                top_p: r.f32()?,
                top_k: r.i32()?,
                min_p: r.f32()?,
                repetition_penalty: r.f32()?,
                presence_penalty: r.f32()?,
                frequency_penalty: r.f32()?,
                penalty_last_n: r.i32()?,
                seed: r.u64()?,
                logit_bias: Vec::new(),
                top_logprobs: r.u32()?,
                want_logprob: r.bool()?,
            };
            let nb = r.count(8)?;
            s.logit_bias = (0..nb)
                .map(|_| Ok((r.i32()?, r.f32()?)))
                .collect::<Result<_, EngineError>>()?;
            Some(s)
        } else {
            None
        };
        let allowed = if flags & F_ALLOWED != 0 {
            Some(r.u32s()?)
        } else {
            None
        };
        out.push(OwnedEntry {
            seq,
            tokens,
            sample,
            fresh: flags & F_FRESH != 0,
            allowed,
            sample_all: flags & F_SAMPLE_ALL != 0,
        });
    }
    Ok(out)
}

pub fn put_step_results(w: &mut Writer, results: &[Option<SampledToken>]) {
    w.len(results.len());
    for r in results {
        match r {
            None => {
                w.bool(false);
            }
            Some(t) => {
                w.bool(true).i32(t.token).f32(t.logprob).len(t.top.len());
                for (tok, lp) in &t.top {
                    w.i32(*tok).f32(*lp);
                }
            }
        }
    }
}

pub fn get_step_results(r: &mut Reader<'_>) -> Result<Vec<Option<SampledToken>>, EngineError> {
    let n = r.count(1)?;
    (0..n)
        .map(|_| {
            if !r.bool()? {
                return Ok(None);
            }
            let token = r.i32()?;
            let logprob = r.f32()?;
            let nt = r.count(8)?;
            let top = (0..nt)
                .map(|_| Ok((r.i32()?, r.f32()?)))
                .collect::<Result<_, EngineError>>()?;
            Ok(Some(SampledToken {
                token,
                logprob,
                top,
            }))
        })
        .collect()
}

#[cfg(test)]
mod tests;
