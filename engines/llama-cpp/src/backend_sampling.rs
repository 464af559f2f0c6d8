//! llama.cpp engine, sampling in the backend (inside `step.rs`'s decode): a sequence whose
//! sampling chain llama.cpp can run in its own graph gets that chain attached to its slot, and
//! its decode brings back the token alone instead of a row of logits for the host to sample.
//!
//! What runs there: greedy, `logit_bias`, top-k, top-p, min-p, temperature and the seeded draw
//! (llama.cpp's backend samplers). What does not, and keeps the host's chain (`sampler.rs`):
//! repetition/frequency/presence penalties, `logprobs`/`top_logprobs` (they need the row's
//! logits), an allowed-token mask (structured output) and verification entries (speculative
//! decoding: several sampled rows of one sequence in one decode). The choice is made per
//! sequence, before the decode that first samples it; a sequence that later needs the host (a
//! mask or a verification appears) moves there for good, its host chain advanced past the
//! draws the backend took, so a seeded sequence draws on from where it was.
//!
//! Attaching or detaching a chain (`llama_set_sampler`) makes llama.cpp reserve its graph
//! again on the next decode (a new scheduler, the worst-case graphs built and measured), so
//! chains change as seldom as they can: a released sequence leaves its chain attached to its
//! slot (an idle slot's chain costs nothing in a decode), and the next sequence there keeps
//! it when it is greedy with the same biases, replaces it in one reservation, or detaches it
//! when it samples on the host. A steady greedy load reserves nothing after its first steps.
//! `GANTRY_LLAMA_BACKEND_SAMPLING` (`0` / `1`) overrides the default (on for a CUDA build, off
//! for a CPU build: see `enabled`).

use std::ptr::NonNull;

use gantry_engine_abi::{Backend, EngineError, Sampling, StepEntry};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_sys_2::{llama_context, llama_sampler};

use crate::sampler::SeqSampler;

/// Whether this build samples in the backend by default: a CUDA build, where the row of
/// logits crosses PCIe and the host samples rows one CPU thread each. A CPU build's backend is
/// the same cores, and measured slower with it (`docs/engines.md`).
pub(crate) fn enabled(build: Backend) -> bool {
    match std::env::var("GANTRY_LLAMA_BACKEND_SAMPLING").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => build == Backend::Cuda,
    }
}

/// Whether `entry`, a sampling entry, can be sampled by a backend chain.
fn fits(p: &Sampling, entry: &StepEntry<'_>) -> bool {
    !p.has_penalties()
        && !p.want_logprob
        && p.top_logprobs == 0
        && entry.allowed.is_none()
        && !entry.verifies()
}

/// llama.cpp's pointer to a context, for the calls llama-cpp-2 does not wrap:
/// `llama_set_sampler` (the binding attaches backend samplers only when it creates a context,
/// for fixed sequence ids, while a chain here belongs to one request) and
/// `llama_perf_context`'s count of reused graphs (`Exec::counters`). Held in `Exec`, next to
/// the context.
#[derive(Clone, Copy)]
pub(crate) struct RawContext(NonNull<llama_context>);

// SAFETY: the pointer is the context's, which `Exec` holds and which is `Send`; it is only
// used while the model's exec mutex is held.
unsafe impl Send for RawContext {}

impl RawContext {
    /// Graphs llama.cpp reused instead of building since the context was made.
    pub(crate) fn graphs_reused(&self) -> u64 {
        // SAFETY: the live context (the caller holds the exec mutex, so no decode runs);
        // `llama_perf_context` only reads its counters.
        let data = unsafe { llama_cpp_sys_2::llama_perf_context(self.0.as_ptr()) };
        data.n_reused.max(0) as u64
    }
}

/// The wrapper keeps the context pointer crate-private; the one public place it appears is its
/// `Debug` output (`LlamaContext { context: 0x… }`), read here and checked against the model
/// before use. `None` when the output has another shape (another llama-cpp-2): backend
/// sampling is then off, the host samples, and graph reuse is not counted.
pub(crate) fn raw_context(ctx: &LlamaContext<'_>, model: &LlamaModel) -> Option<RawContext> {
    let shown = format!("{ctx:?}");
    let hex = shown.split("context: 0x").nth(1)?;
    let hex: String = hex.chars().take_while(char::is_ascii_hexdigit).collect();
    let addr = usize::from_str_radix(&hex, 16).ok()?;
    if addr % std::mem::align_of::<usize>() != 0 {
        return None;
    }
    let raw = NonNull::new(addr as *mut llama_context)?;
    // SAFETY: `raw` is the context's own pointer, as the wrapper printed it; the context is
    // alive (borrowed by `ctx`), and `llama_get_model` only reads its model field.
    let owner = unsafe { llama_cpp_sys_2::llama_get_model(raw.as_ptr()) };
    (owner.cast_mut() == crate::adapters::raw_model(model)).then_some(RawContext(raw))
}

/// Attaches chains to the slots of one context (held in `Exec`, next to the context).
pub(crate) struct Attacher {
    ctx: NonNull<llama_context>,
    /// Chains llama.cpp took (each made it reserve its graphs again).
    pub(crate) attached: std::cell::Cell<u64>,
}

// SAFETY: the pointer is the context's, which `Exec` holds and which is `Send`; it is only
// used while the model's exec mutex is held.
unsafe impl Send for Attacher {}

impl Attacher {
    pub(crate) fn new(raw: RawContext) -> Attacher {
        Attacher {
            ctx: raw.0,
            attached: std::cell::Cell::new(0),
        }
    }

    /// The chain for `p` (which [`fits`]), attached to `slot`; `None` when llama.cpp does not
    /// take it (the host then samples the sequence).
    pub(crate) fn attach(&self, slot: i32, p: &Sampling, n_vocab: i32) -> Option<BackendChain> {
        let raw = new_chain(p, n_vocab)?;
        // Owned from here: a chain llama.cpp does not take is freed on return.
        let chain = BackendChain {
            raw,
            slot,
            draws: 0,
            greedy_bias: p.is_greedy().then(|| p.logit_bias.clone()),
        };
        // SAFETY: `ctx` is the live context; the chain outlives its attachment (it is freed
        // only once detached, replaced by another chain, or once the context is gone: see its
        // `Drop`), as llama.h asks.
        let taken =
            unsafe { llama_cpp_sys_2::llama_set_sampler(self.ctx.as_ptr(), slot, raw.as_ptr()) };
        if taken {
            self.attached.set(self.attached.get() + 1);
        }
        taken.then_some(chain)
    }

    /// Whether this backend samples every chain `attach` builds: one decode of one token per
    /// kind of chain (the longest seeded one and greedy with biases) on slot 0 of an idle
    /// context, which must come back with a token. A backend that lacks an op of one of them
    /// (llama.cpp then runs the chain only up to it, and the token is left to the host) would
    /// otherwise fail every request it takes; the caller samples on the host instead. The
    /// slot's cells are cleared afterwards.
    pub(crate) fn probe(&self, ctx: &mut LlamaContext<'_>, n_vocab: i32) -> Result<(), String> {
        let seeded = Sampling {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: 1,
            logit_bias: vec![(0, -1.0)],
            ..Sampling::greedy()
        };
        let greedy = Sampling {
            logit_bias: vec![(0, -1.0)],
            ..Sampling::greedy()
        };
        let mut batch = LlamaBatch::new(1, 1);
        for p in [&seeded, &greedy] {
            let chain = self
                .attach(0, p, n_vocab)
                .ok_or_else(|| format!("llama.cpp does not take the chain of {p:?}"))?;
            batch.clear();
            let outcome = batch
                .add(LlamaToken(0), 0, &[0], true)
                .map_err(|e| e.to_string())
                .and_then(|()| ctx.decode(&mut batch).map_err(|e| e.to_string()))
                .and_then(|()| {
                    ctx.sampled_token_ith(0)
                        .map(drop)
                        .ok_or_else(|| format!("the backend sampled no token with {p:?}"))
                });
            let _ = ctx.clear_kv_cache_seq(Some(0), None, None);
            self.detach(chain);
            outcome?;
        }
        Ok(())
    }

    /// Detach `chain` from its slot; it is freed as it drops.
    pub(crate) fn detach(&self, chain: BackendChain) {
        // SAFETY: `ctx` is the live context the chain was attached to; after this call it no
        // longer reads the chain.
        unsafe {
            llama_cpp_sys_2::llama_set_sampler(self.ctx.as_ptr(), chain.slot, std::ptr::null_mut())
        };
    }
}

/// The top-p that orders a top-k chain's candidates (see `new_chain`): the largest
/// f32 below 1.
const ORDER_TOP_P: f32 = 1.0 - f32::EPSILON / 2.0;

/// One sequence's chain of backend samplers, attached to its slot until [`Attacher::detach`]
/// or another chain's attachment replaces it; `draws` counts the tokens it sampled (each a
/// draw of its RNG when it is not greedy).
pub(crate) struct BackendChain {
    raw: NonNull<llama_sampler>,
    slot: i32,
    pub(crate) draws: usize,
    /// A greedy chain's biases: such a chain has no state, and serves any greedy request
    /// with the same biases. `None` for a seeded draw, which belongs to its request.
    greedy_bias: Option<Vec<(i32, f32)>>,
}

// SAFETY: a llama_sampler is plain heap state with no thread affinity; it is only touched
// while the model's exec mutex is held (the context reads it during `llama_decode`, under
// the same lock).
unsafe impl Send for BackendChain {}

/// A new llama.cpp chain of backend samplers for `p` (which [`fits`]), owned by the caller.
fn new_chain(p: &Sampling, n_vocab: i32) -> Option<NonNull<llama_sampler>> {
    use llama_cpp_sys_2 as sys;
    // SAFETY: every sampler is created here and handed to the chain, which owns it from
    // `llama_sampler_chain_add` on; the bias array is copied by `init_logit_bias`.
    unsafe {
        let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
        let add = |s: *mut llama_sampler| sys::llama_sampler_chain_add(chain, s);
        if !p.logit_bias.is_empty() {
            let biases: Vec<sys::llama_logit_bias> = p
                .logit_bias
                .iter()
                .map(|&(token, bias)| sys::llama_logit_bias { token, bias })
                .collect();
            add(sys::llama_sampler_init_logit_bias(
                n_vocab,
                biases.len() as i32,
                biases.as_ptr(),
            ));
        }
        if p.is_greedy() {
            add(sys::llama_sampler_init_greedy());
        } else {
            if p.top_k > 0 {
                add(sys::llama_sampler_init_top_k(p.top_k));
            }
            if p.top_p < 1.0 {
                add(sys::llama_sampler_init_top_p(p.top_p, 1));
            } else if p.top_k > 0 {
                // ggml's top-k returns its k tokens in no particular order, and the draw
                // walks the candidates in order: the same seed would pick another token
                // than the host's top-k, which sorts them. A top-p just below 1 sorts them
                // (descending, as the host) and keeps them all but a tail that float
                // rounding puts past it (the last ~1e-6 of the mass at most).
                add(sys::llama_sampler_init_top_p(ORDER_TOP_P, 1));
            }
            if p.min_p > 0.0 {
                add(sys::llama_sampler_init_min_p(p.min_p, 1));
            }
            add(sys::llama_sampler_init_temp(p.temperature));
            add(sys::llama_sampler_init_dist(crate::sampler::seed32(p.seed)));
        }
        NonNull::new(chain)
    }
}

impl BackendChain {
    /// Which chain this is (its address), for tests.
    #[cfg(test)]
    pub(crate) fn id(&self) -> usize {
        self.raw.as_ptr() as usize
    }

    /// Whether this chain samples what `p` (which [`fits`]) asks, as it is.
    fn serves(&self, p: &Sampling) -> bool {
        p.is_greedy() && self.greedy_bias.as_ref() == Some(&p.logit_bias)
    }

    /// The token the backend sampled for batch row `row` of the last decode, accepted into
    /// the chain (llama.cpp advances a chain's state when its token is accepted).
    pub(crate) fn take(&mut self, ctx: &LlamaContext<'_>, row: i32) -> Result<i32, EngineError> {
        let token = ctx.sampled_token_ith(row).ok_or_else(|| {
            EngineError::internal(format!(
                "slot {}: llama.cpp's backend sampled no token for batch row {row}",
                self.slot
            ))
        })?;
        // SAFETY: `raw` is this chain, alive; accept only updates its samplers' state.
        unsafe { llama_cpp_sys_2::llama_sampler_accept(self.raw.as_ptr(), token.0) };
        self.draws += 1;
        Ok(token.0)
    }
}

impl Drop for BackendChain {
    fn drop(&mut self) {
        // SAFETY: the chain came from `llama_sampler_chain_init` and is freed once, here (with
        // its samplers), when no context reads it: it was never attached, or was detached
        // or replaced on its slot (`Exec::choose_samplers`, `Attacher::probe`), or its context
        // is gone (`LlamaLoaded`'s `Drop` frees the context before the sequences and the free
        // slots that hold chains).
        unsafe { llama_cpp_sys_2::llama_sampler_free(self.raw.as_ptr()) };
    }
}

impl crate::slots::Exec {
    /// Before a step's decodes: attach a backend chain to each bound sequence that samples in
    /// this step, has no sampler yet and [`fits`]; move to the host a sequence whose chain no
    /// longer fits (a mask or a verification entry appeared), with its host chain past the
    /// draws the backend took. `n_ctx` is a sequence's context (the host chain's penalty
    /// window, see `SeqSampler::new`).
    pub(crate) fn choose_samplers(&mut self, entries: &[StepEntry<'_>], n_vocab: i32, n_ctx: u32) {
        let Some(attacher) = &self.attacher else {
            return;
        };
        for e in entries {
            let (Some(p), Some(s)) = (e.sample, self.seqs.get_mut(&e.seq)) else {
                continue;
            };
            let Some(slot) = s.slot else { continue };
            let fits = fits(p, e);
            let inherited = s.inherited.take();
            if let Some(chain) = s.backend.take_if(|_| !fits) {
                let draws = chain.draws;
                attacher.detach(chain);
                let mut host = SeqSampler::new(p, n_vocab, n_ctx);
                host.skip_draws(draws);
                s.sampler = Some(host);
            } else if fits && s.backend.is_none() && s.sampler.is_none() {
                s.backend = match inherited {
                    // A greedy chain has no state: the next sequence may run it as it is.
                    Some(old) if old.serves(p) => Some(old),
                    old => {
                        // Attaching replaces the slot's old chain (which then drops).
                        let new = attacher.attach(slot, p, n_vocab);
                        if let (None, Some(old)) = (&new, old) {
                            attacher.detach(old);
                        }
                        new
                    }
                };
            } else if let Some(old) = inherited {
                // Sampled on the host: llama.cpp must not sample it in the graph.
                attacher.detach(old);
            }
        }
    }
}

#[cfg(test)]
mod tests;
