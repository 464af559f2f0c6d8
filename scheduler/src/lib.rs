//! The scheduler (`gantry-scheduler`; between request validation and the engine): one owner
//! thread per loaded replica of a model, continuous batching over any [`Engine`].
//!
//! HTTP handlers hold a [`SchedulerHandle`] and send [`Job`]s; each job's tokens come back on
//! its own channel as [`GenEvent`]s. Every iteration the thread (`run.rs`):
//!
//! 1. takes new jobs (FIFO);
//! 2. releases sequences whose client went away (a closed event channel) or whose deadline
//!    passed — before the next step, without touching others;
//! 3. admits waiting jobs while a sequence slot and KV cells are free ([`batch`]);
//! 4. builds one step: one decode token for every generating sequence plus at most
//!    `prefill_chunk_tokens` prompt tokens ([`batch::plan_step`]);
//! 5. computes the allowed-token masks of the constrained sequences that sample in this step
//!    (in parallel across the batch);
//! 6. runs the engine step, then turns each sampled token into text (`text_stream.rs`:
//!    incremental UTF-8, stop sequences) and sends it (`step.rs`).
//!
//! A watchdog thread (`watchdog.rs`) reads the step's start time and acts on an overrun as
//! the engine says ([`Overrun`]). When the engine's worker dies, every call fails with the
//! crash: the jobs that had not received a token go to the [`Watch::requeue`] hook (the
//! node sends them to the restarted model, once), the others end with
//! [`GenError::Crashed`], and every later job is answered the same way until the node
//! drops the scheduler.

mod adapters;
pub mod batch;
mod counters;
pub mod draft;
pub mod draft_len;
mod draft_model;
mod engine;
mod handle;
mod job;
mod metrics;
mod run;
mod speech;
mod step;
pub mod text_stream;
mod watchdog;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

pub use draft_model::DraftModel;
pub use engine::{Engine, EngineLimits, Grammar, Overrun};
pub use handle::{Figures, ModelFigures, SchedulerHandle};
pub use job::{
    AdapterJob, EmbedJob, FinishReason, GenError, GenEvent, GenerateJob, Job, Requeue, TokenLogprob,
};
pub use metrics::SchedulerMetrics;
pub use run::SchedulerSettings;
pub use speech::{SpeechEvent, SpeechJob};

use batch::Capacity;
use run::Scheduler;

/// What a scheduler reports to beyond its model: the node's hung flag (in-process engines)
/// and where crash-interrupted jobs go (`process` isolation).
#[derive(Clone)]
pub struct Watch {
    pub hung: Arc<AtomicBool>,
    pub requeue: Option<Requeue>,
}

/// Start the scheduler thread (and its watchdog) of one loaded replica of a model; `replica`
/// is its index in `model_figures`. With `draft`, the replica's drafts come from that model
/// (`draft_model.rs`) instead of prompt lookup.
pub fn spawn<E: Engine>(
    engine: E,
    draft: Option<DraftModel>,
    metrics: SchedulerMetrics,
    settings: SchedulerSettings,
    watch: Watch,
    model_figures: Arc<ModelFigures>,
    replica: usize,
) -> std::io::Result<SchedulerHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let limits = engine.limits();
    let figures = model_figures
        .replicas
        .get(replica)
        .cloned()
        .unwrap_or_default();
    let handle = SchedulerHandle {
        tx,
        figures: figures.clone(),
        kv_capacity: limits.kv_capacity_tokens,
        context_length: limits.context_length,
    };
    let epoch = Instant::now();
    let overrun = engine.on_overrun();
    metrics
        .kv_cache_capacity
        .set(model_figures.kv_capacity as f64);
    let model = metrics.model.clone();
    let s = Scheduler {
        engine,
        rx,
        waiting: VecDeque::new(),
        running: Vec::new(),
        figures: figures.clone(),
        metrics: metrics.clone(),
        settings: settings.clone(),
        eog: limits.eog_tokens,
        epoch,
        capacity: Capacity {
            max_sequences: limits.max_sequences.max(1),
            kv_tokens: limits.kv_capacity_tokens,
        },
        model_figures,
        requeue: watch.requeue,
        crashed: None,
        drafts: limits.speculation && settings.speculation.enabled(),
        context_length: limits.context_length as usize,
        adapters: Default::default(),
        draft,
        audio_rate: limits.audio_sample_rate,
        speeches: VecDeque::new(),
        counters: Default::default(),
        step_costs: Default::default(),
        acceptance: crate::draft_len::Acceptance::NONE,
    };
    let name = if replica == 0 {
        format!("sched-{model}")
    } else {
        format!("sched-{model}-{replica}")
    };
    std::thread::Builder::new()
        .name(name)
        .spawn(move || s.run())?;
    watchdog::spawn(
        &figures,
        epoch,
        settings.step_timeout,
        overrun,
        watch.hung,
        metrics,
    )?;
    Ok(handle)
}
