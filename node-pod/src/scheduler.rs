//! Scheduler (between validation and the engine host): one owner per model, continuous batching.
//!
//! Each loaded model gets one OS thread that owns its [`ModelExec`] and all
//! scheduling state; HTTP handlers talk to it over a channel and receive
//! their tokens on a per-request channel. Every iteration:
//!
//! 1. takes new jobs (FIFO);
//! 2. releases sequences whose client went away (a closed event channel) or
//!    whose deadline passed — before the next step, without touching others;
//! 3. admits waiting jobs while a sequence slot and KV cells are free;
//! 4. builds one step: one decode token for every generating sequence plus at
//!    most `prefill_chunk_tokens` prompt tokens, so a long prompt is fed in
//!    chunks and never stalls the running streams for more than one chunk;
//! 5. computes the allowed-token masks of the constrained sequences that sample in
//!    this step (in parallel across the batch; the mask for a token depends on the
//!    token before it, so it cannot start before the previous step ended);
//! 6. runs the engine step, then turns each sampled token into text
//!    (incremental UTF-8, stop sequences, EOS, grammar end, `max_tokens`) and sends it.
//!
//! The step runs on this thread; a watchdog thread reads the step's start
//! time and marks the engine hung when a step overruns (`/healthz` fails) — or, for a
//! model in its own worker process (`process` isolation), kills that worker.
//!
//! When the model's worker dies, every call fails with the crash: the requests that had
//! not received a token go back to the node (node/crash.rs sends them to the restarted
//! model, once), the others end with 503 `engine_crashed`, and the scheduler answers every
//! later job the same way until the node drops it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use gantry_engine_abi::{EngineError, Sampling, Status, StepEntry};
use tokio::sync::{mpsc, oneshot};

use crate::constraint::Constraint;
use crate::engine_host::{ModelExec, ModelShared};
use crate::metrics::{Metrics, ModelMetrics};
use crate::text::{StopMatcher, StopScan, Utf8Stream};

/// Why a generation ended (OpenAI's `finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The request deadline passed while it generated. OpenAI has no such finish reason: a
    /// stream ends with an error event, a plain request as docs/node.md says.
    Deadline,
    /// The deadline passed while the request was still queued: no token was generated, and
    /// the client gets a 504 before any byte.
    QueueTimeout,
    /// The request failed while it generated (its grammar); an `Error` event was sent
    /// instead of `Done`.
    Failed,
}

impl FinishReason {
    /// The OpenAI `finish_reason`; the deadline kinds only reach a client as `length` where
    /// docs/node.md says so (a plain request without `max_tokens`).
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::Failed => "stop",
            FinishReason::Length | FinishReason::Deadline | FinishReason::QueueTimeout => "length",
        }
    }

    /// The `reason` label of `gantry_request_finish_total`.
    pub fn label(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Deadline => "deadline",
            FinishReason::QueueTimeout => "queue_timeout",
            FinishReason::Failed => "error",
        }
    }
}

/// Log probability of one token, with its text.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: i32,
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(i32, String, Vec<u8>, f32)>,
}

/// What a job's event channel carries.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// One generated token: the text it completes (possibly empty while a
    /// multi-byte character or a possible stop sequence is pending).
    Token {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The end, with usage and the time spent queued.
    Done {
        reason: FinishReason,
        prompt_tokens: u32,
        /// Prompt tokens the engine took from its prefix cache; `None` when it does not say
        /// (ABI 1.4 `seq_cached_tokens`) or the prompt never reached it.
        cached_tokens: Option<u32>,
        completion_tokens: u32,
        queued: Duration,
    },
    /// The engine failed; no more events follow.
    Error(EngineError),
}

/// A generation request, validated and tokenized.
#[derive(Debug)]
pub struct GenerateJob {
    pub prompt: Vec<i32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    /// `Some(n)`: report logprobs with `n` alternatives.
    pub logprobs: Option<u32>,
    pub deadline: Option<Instant>,
    /// Evaluate from scratch (no cached prefix): the request gave a `seed`.
    pub fresh: bool,
    /// The grammar the output must follow (structured outputs, forced tool calls): each
    /// sampling step gets its allowed-token mask.
    pub constraint: Option<Box<Constraint>>,
    pub arrived: Instant,
    pub events: mpsc::UnboundedSender<GenEvent>,
    /// A worker crash already interrupted it once (it is not retried twice).
    pub retried: bool,
}

/// Where a scheduler sends the jobs its worker's crash interrupted before their first token.
pub type Requeue = Arc<dyn Fn(Vec<GenerateJob>, crate::engine_host::worker::Crash) + Send + Sync>;

/// What a scheduler reports to beyond its model: the node's hung flag (in-process engines)
/// and where crash-interrupted jobs go (`process` isolation).
#[derive(Clone)]
pub struct Watch {
    pub hung: Arc<AtomicBool>,
    pub requeue: Option<Requeue>,
}

/// An embedding request.
#[derive(Debug)]
pub struct EmbedJob {
    pub tokens: Vec<i32>,
    pub reply: oneshot::Sender<Result<Vec<f32>, EngineError>>,
}

#[derive(Debug)]
pub enum Job {
    Generate(GenerateJob),
    Embed(EmbedJob),
}

/// Live figures for `/v1/status` and the gauges.
#[derive(Debug, Default)]
pub struct Figures {
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    pub kv_used: AtomicU64,
    /// Start of the step in flight (ms since the scheduler's epoch + 1), 0 when idle.
    pub step_started_ms: AtomicU64,
}

/// The figures of every replica of one model: what its per-model gauges and its
/// `/v1/status` entry add up.
#[derive(Debug, Default)]
pub struct ModelFigures {
    pub replicas: Vec<Arc<Figures>>,
    /// KV cells of all replicas together.
    pub kv_capacity: u64,
}

impl ModelFigures {
    /// Fresh figures for replicas with these KV capacities (one entry per replica).
    pub fn new(kv_capacities: &[u64]) -> Arc<Self> {
        Arc::new(Self {
            replicas: kv_capacities.iter().map(|_| Arc::default()).collect(),
            kv_capacity: kv_capacities.iter().sum(),
        })
    }

    fn sum(&self, f: impl Fn(&Figures) -> &AtomicU64) -> u64 {
        self.replicas
            .iter()
            .map(|r| f(r).load(Ordering::Relaxed))
            .sum()
    }
    pub fn waiting(&self) -> u64 {
        self.sum(|f| &f.waiting)
    }
    pub fn running(&self) -> u64 {
        self.sum(|f| &f.running)
    }
    pub fn kv_used(&self) -> u64 {
        self.sum(|f| &f.kv_used)
    }
}

/// The HTTP side's handle on one replica's scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerHandle {
    tx: Sender<Job>,
    pub figures: Arc<Figures>,
    pub kv_capacity: u64,
    pub context_length: u32,
}

impl SchedulerHandle {
    /// Queue a job; fails only when the scheduler thread is gone.
    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        self.figures.waiting.fetch_add(1, Ordering::Relaxed);
        self.tx.send(job).map_err(|_| {
            self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
            EngineError::internal("the model's scheduler has stopped")
        })
    }

    /// Queue a generation; the job back when the scheduler thread is gone.
    pub fn submit_or_return(&self, job: GenerateJob) -> Result<(), Box<GenerateJob>> {
        self.figures.waiting.fetch_add(1, Ordering::Relaxed);
        self.tx.send(Job::Generate(job)).map_err(|e| {
            self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
            match e.0 {
                Job::Generate(j) => Box::new(j),
                Job::Embed(_) => unreachable!("a generation was sent"),
            }
        })
    }
}

/// One engine instance of a model (a replica) and its scheduler.
pub struct Replica {
    pub scheduler: SchedulerHandle,
    pub shared: Arc<ModelShared>,
}

/// Every replica of a loaded model (seed 001: replicas with round-robin): each request
/// goes to the next replica in turn. One replica is the common case; its behaviour is
/// exactly a single scheduler's.
pub struct Replicas {
    replicas: Vec<Replica>,
    next: AtomicU64,
    pub figures: Arc<ModelFigures>,
}

impl Replicas {
    /// A model has at least one replica; an empty list is refused.
    pub fn new(replicas: Vec<Replica>, figures: Arc<ModelFigures>) -> Result<Self, EngineError> {
        if replicas.is_empty() {
            return Err(EngineError::internal("a model needs at least one replica"));
        }
        Ok(Self {
            replicas,
            next: AtomicU64::new(0),
            figures,
        })
    }

    /// Queue a job on the next replica in turn.
    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % self.replicas.len();
        self.replicas[i].scheduler.submit(job)
    }

    /// [`Replicas::submit`] for a generation, with the job back when the scheduler is gone.
    pub fn submit_or_return(&self, job: GenerateJob) -> Result<(), Box<GenerateJob>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % self.replicas.len();
        self.replicas[i].scheduler.submit_or_return(job)
    }

    /// Per-sequence context: the same on every replica (one config).
    pub fn context_length(&self) -> u32 {
        self.replicas[0].scheduler.context_length
    }

    /// What the engines report holding, all replicas together.
    pub fn bytes_used(&self) -> u64 {
        self.replicas
            .iter()
            .map(|r| r.shared.info().bytes_used)
            .sum()
    }

    /// Nothing queued or running on any replica.
    pub fn idle(&self) -> bool {
        self.figures.waiting() == 0 && self.figures.running() == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &Replica> {
        self.replicas.iter()
    }

    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }
}

#[derive(Clone, Debug)]
pub struct SchedulerSettings {
    pub prefill_chunk_tokens: usize,
    pub step_timeout: Duration,
}

/// A sequence in the engine.
struct Running {
    job: GenerateJob,
    seq: u64,
    /// Prompt tokens fed so far.
    fed: usize,
    /// Prompt tokens the engine took from its cache, once its first chunk ran and if it says.
    cached: Option<u32>,
    /// Token to feed next step once decoding.
    next: Option<i32>,
    /// Sampled tokens fed back into the KV cache.
    fed_decode: usize,
    /// Tokens delivered to the client (`usage.completion_tokens`).
    generated: u32,
    utf8: Utf8Stream,
    stops: StopMatcher,
    /// Time from arrival to admission.
    queued: Duration,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
}

impl Running {
    fn kv_tokens(&self) -> u64 {
        (self.fed + self.fed_decode) as u64
    }
    fn decoding(&self) -> bool {
        self.fed == self.job.prompt.len()
    }
}

struct Scheduler {
    model_id: String,
    exec: ModelExec,
    shared: Arc<ModelShared>,
    rx: Receiver<Job>,
    waiting: VecDeque<GenerateJob>,
    running: Vec<Running>,
    figures: Arc<Figures>,
    metrics: ModelMetrics,
    settings: SchedulerSettings,
    eog: Vec<i32>,
    epoch: Instant,
    max_seqs: usize,
    kv_capacity: u64,
    /// Every replica's figures (this one's among them), which the per-model gauges sum.
    model_figures: Arc<ModelFigures>,
    requeue: Option<Requeue>,
    /// The worker crash that ended this engine instance; every job after it fails at once.
    crashed: Option<crate::engine_host::worker::Crash>,
}

/// Start the scheduler thread of one loaded replica of a model; `replica` is its index in
/// `model_figures`.
pub fn spawn(
    model_id: String,
    exec: ModelExec,
    metrics: Metrics,
    settings: SchedulerSettings,
    watch: Watch,
    model_figures: Arc<ModelFigures>,
    replica: usize,
) -> std::io::Result<SchedulerHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let shared = exec.shared().clone();
    let info = shared.info().clone();
    let figures = model_figures
        .replicas
        .get(replica)
        .cloned()
        .unwrap_or_default();
    let handle = SchedulerHandle {
        tx,
        figures: figures.clone(),
        kv_capacity: info.kv_capacity_tokens,
        context_length: info.context_length,
    };
    let epoch = Instant::now();
    let worker = exec.worker();
    metrics
        .kv_cache_capacity_tokens
        .with_label_values(&[&model_id])
        .set(model_figures.kv_capacity as f64);
    let s = Scheduler {
        model_id: model_id.clone(),
        exec,
        shared,
        rx,
        waiting: VecDeque::new(),
        running: Vec::new(),
        figures: figures.clone(),
        metrics: metrics.for_model(&model_id),
        settings: settings.clone(),
        eog: info.eog_tokens.clone(),
        epoch,
        max_seqs: info.max_sequences.max(1) as usize,
        kv_capacity: info.kv_capacity_tokens,
        model_figures,
        requeue: watch.requeue,
        crashed: None,
    };
    let name = if replica == 0 {
        format!("sched-{model_id}")
    } else {
        format!("sched-{model_id}-{replica}")
    };
    std::thread::Builder::new()
        .name(name)
        .spawn(move || s.run())?;
    spawn_watchdog(
        model_id,
        figures,
        epoch,
        settings.step_timeout,
        Overrun {
            hung: watch.hung,
            worker: worker.as_ref().map(Arc::downgrade),
        },
        metrics,
    )?;
    Ok(handle)
}

/// What the watchdog does about a step that overran.
struct Overrun {
    /// In-process: mark the node hung.
    hung: Arc<AtomicBool>,
    /// In a worker: kill the worker (the crash path restarts the model).
    worker: Option<std::sync::Weak<crate::engine_host::worker::Worker>>,
}

/// Acts when one step runs longer than `limit`. A hung in-process plugin cannot be
/// interrupted; failing `/healthz` lets Kubernetes restart the pod, as the specification
/// asks. A hung plugin in a worker is killed, and only its model restarts.
fn spawn_watchdog(
    model_id: String,
    figures: Arc<Figures>,
    epoch: Instant,
    limit: Duration,
    overrun: Overrun,
    metrics: Metrics,
) -> std::io::Result<()> {
    let weak = Arc::downgrade(&figures);
    drop(figures);
    std::thread::Builder::new().name(format!("watchdog-{model_id}")).spawn(move || {
        let tick = (limit / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
        while let Some(f) = weak.upgrade() {
            let started = f.step_started_ms.load(Ordering::Relaxed);
            if started > 0 {
                let now_ms = epoch.elapsed().as_millis() as u64 + 1;
                if Duration::from_millis(now_ms.saturating_sub(started)) > limit {
                    if let Some(w) = overrun.worker.as_ref().and_then(std::sync::Weak::upgrade) {
                        tracing::error!(target: "gantry::alert", model = %model_id, limit_s = limit.as_secs_f64(), pid = w.pid(), "engine step overran the watchdog; killing its worker");
                        w.kill_hung();
                        return;
                    }
                    if overrun.worker.is_none() && !overrun.hung.swap(true, Ordering::SeqCst) {
                        metrics.engine_hung.set(1);
                        tracing::error!(target: "gantry::alert", model = %model_id, limit_s = limit.as_secs_f64(), "engine step overran the watchdog; marking the engine hung");
                    }
                }
            }
            drop(f);
            std::thread::sleep(tick);
        }
    })?;
    Ok(())
}

impl Scheduler {
    fn run(mut self) {
        loop {
            if !self.intake() {
                break; // every sender dropped: the model is being unloaded
            }
            self.drop_abandoned();
            self.admit();
            self.publish();
            if !self.running.is_empty() {
                self.step();
                self.publish();
            }
        }
        for r in std::mem::take(&mut self.running) {
            self.exec.seq_release(r.seq);
        }
    }

    /// Take queued jobs; block while idle. Returns false when the channel closed.
    fn intake(&mut self) -> bool {
        let idle = self.running.is_empty() && self.waiting.is_empty();
        if idle {
            match self.rx.recv_timeout(Duration::from_millis(250)) {
                Ok(job) => self.accept(job),
                Err(RecvTimeoutError::Timeout) => return true,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(job) => self.accept(job),
                Err(std::sync::mpsc::TryRecvError::Empty) => return true,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    return !(self.running.is_empty() && self.waiting.is_empty());
                }
            }
        }
    }

    fn accept(&mut self, job: Job) {
        if let Some(crash) = self.crashed.clone() {
            // The worker is gone: nothing here can run this job.
            self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
            match job {
                Job::Generate(g) => self.hand_back(vec![g], &crash),
                Job::Embed(e) => {
                    let _ = e.reply.send(Err(crash.error()));
                }
            }
            return;
        }
        match job {
            Job::Generate(g) => self.waiting.push_back(g),
            Job::Embed(e) => {
                // Embeddings run between steps, in arrival order with the rest.
                self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
                let result = self.exec.embed(&e.tokens);
                let _ = e.reply.send(result);
                self.check_crash();
            }
        }
    }

    /// After a failed call: when the worker died, end or hand back every job.
    fn check_crash(&mut self) -> bool {
        if self.crashed.is_some() {
            return true;
        }
        let Some(crash) = self.exec.crashed() else {
            return false;
        };
        self.crashed = Some(crash.clone());
        let mut back: Vec<GenerateJob> = Vec::new();
        for r in std::mem::take(&mut self.running) {
            if r.generated == 0 && r.first_token_at.is_none() {
                back.push(r.job);
            } else {
                self.metrics.finished("error");
                let _ = r.job.events.send(GenEvent::Error(crash.error()));
            }
        }
        self.figures
            .waiting
            .fetch_sub(self.waiting.len() as u64, Ordering::Relaxed);
        back.extend(self.waiting.drain(..));
        self.hand_back(back, &crash);
        self.publish();
        true
    }

    /// Jobs the crash interrupted before their first token: to the node for one retry.
    fn hand_back(&self, jobs: Vec<GenerateJob>, crash: &crate::engine_host::worker::Crash) {
        let (retry, fail): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|j| !j.retried);
        for j in fail {
            self.metrics.finished("error");
            let _ = j.events.send(GenEvent::Error(crash.error()));
        }
        if retry.is_empty() {
            return;
        }
        match &self.requeue {
            Some(requeue) => requeue(
                retry
                    .into_iter()
                    .map(|mut j| {
                        j.retried = true;
                        j
                    })
                    .collect(),
                crash.clone(),
            ),
            None => {
                for j in retry {
                    self.metrics.finished("error");
                    let _ = j.events.send(GenEvent::Error(crash.error()));
                }
            }
        }
    }

    /// Release sequences nobody listens to, and end those past their deadline.
    fn drop_abandoned(&mut self) {
        let now = Instant::now();
        let before = self.waiting.len();
        let metrics = &self.metrics;
        self.waiting.retain(|j| {
            if j.events.is_closed() {
                metrics.finished("cancelled");
                return false;
            }
            if j.deadline.is_some_and(|d| d <= now) {
                // Expired in the queue: nothing was generated; the client gets a 504.
                let queued = now - j.arrived;
                metrics.queue_seconds.observe(queued.as_secs_f64());
                metrics.finished(FinishReason::QueueTimeout.label());
                let _ = j.events.send(GenEvent::Done {
                    reason: FinishReason::QueueTimeout,
                    prompt_tokens: j.prompt.len() as u32,
                    cached_tokens: None,
                    completion_tokens: 0,
                    queued,
                });
                return false;
            }
            true
        });
        let dropped = before - self.waiting.len();
        self.figures
            .waiting
            .fetch_sub(dropped as u64, Ordering::Relaxed);
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.job.events.is_closed() {
                let r = self.running.swap_remove(i);
                self.exec.seq_release(r.seq);
                self.metrics.finished("cancelled");
                tracing::debug!(model = %self.model_id, seq = r.seq, "client gone; sequence released");
            } else if r.job.deadline.is_some_and(|d| d <= now) {
                let r = self.running.swap_remove(i);
                self.finish(r, FinishReason::Deadline);
            } else {
                i += 1;
            }
        }
    }

    fn kv_used(&self) -> u64 {
        self.running.iter().map(Running::kv_tokens).sum()
    }

    /// FIFO admission: the head of the queue waits for a slot and enough KV
    /// for its prompt; nobody overtakes it.
    fn admit(&mut self) {
        while let Some(head) = self.waiting.front() {
            if self.running.len() >= self.max_seqs
                || self.kv_used() + head.prompt.len() as u64 > self.kv_capacity
            {
                break;
            }
            let seq = match self.exec.seq_open() {
                Ok(s) => s,
                Err(_) if self.check_crash() => break,
                Err(e) if matches!(e.status, Status::OomVram | Status::OomRam) => break,
                Err(e) => {
                    if let Some(job) = self.waiting.pop_front() {
                        self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
                        self.metrics.finished("error");
                        let _ = job.events.send(GenEvent::Error(e));
                    }
                    continue;
                }
            };
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
            self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
            let queued = job.arrived.elapsed();
            self.metrics.queue_seconds.observe(queued.as_secs_f64());
            let stops = StopMatcher::new(job.stop.clone());
            self.running.push(Running {
                job,
                seq,
                fed: 0,
                cached: None,
                next: None,
                fed_decode: 0,
                generated: 0,
                utf8: Utf8Stream::default(),
                stops,
                queued,
                first_token_at: None,
                last_token_at: None,
            });
        }
    }

    fn publish(&self) {
        let kv = self.kv_used();
        self.figures
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        self.figures.kv_used.store(kv, Ordering::Relaxed);
        // The gauges are per model: the sums over its replicas.
        let all = &self.model_figures;
        self.metrics.requests_running.set(all.running() as f64);
        self.metrics.requests_waiting.set(all.waiting() as f64);
        let usage = if all.kv_capacity == 0 {
            0.0
        } else {
            all.kv_used() as f64 / all.kv_capacity as f64
        };
        self.metrics.kv_cache_usage.set(usage);
    }

    fn step(&mut self) {
        // Which running sequence each entry belongs to, and how many prompt tokens it feeds.
        let mut plan: Vec<(usize, usize)> = Vec::with_capacity(self.running.len());
        let mut budget = self.settings.prefill_chunk_tokens;
        for (i, r) in self.running.iter().enumerate() {
            if r.decoding() {
                if r.next.is_some() {
                    plan.push((i, 0));
                }
            } else if budget > 0 {
                let n = (r.job.prompt.len() - r.fed).min(budget);
                budget -= n;
                plan.push((i, n));
            }
        }
        if plan.is_empty() {
            return;
        }
        if !self.compute_masks(&plan) {
            return; // a grammar failed: its request ended; plan again without it
        }
        let mut decode_tokens: Vec<[i32; 1]> = Vec::with_capacity(plan.len());
        for &(i, n) in &plan {
            if n == 0 {
                decode_tokens.push([self.running[i].next.unwrap_or_default()]);
            }
        }
        let mut d = 0;
        let mut entries: Vec<StepEntry<'_>> = Vec::with_capacity(plan.len());
        let mut total = 0usize;
        for &(i, n) in &plan {
            let r = &self.running[i];
            let (tokens, sample): (&[i32], bool) = if n == 0 {
                d += 1;
                (&decode_tokens[d - 1], true)
            } else {
                // Sample only once the chunk completes the prompt.
                (
                    &r.job.prompt[r.fed..r.fed + n],
                    r.fed + n == r.job.prompt.len(),
                )
            };
            total += tokens.len();
            entries.push(StepEntry {
                seq: r.seq,
                tokens,
                sample: sample.then_some(&r.job.sampling),
                fresh: r.job.fresh,
                allowed: r
                    .job
                    .constraint
                    .as_deref()
                    .filter(|_| sample)
                    .map(Constraint::mask),
            });
        }
        self.metrics.steps.inc();
        self.metrics.step_tokens.observe(total as f64);
        self.figures.step_started_ms.store(
            self.epoch.elapsed().as_millis() as u64 + 1,
            Ordering::Relaxed,
        );
        let result = self.exec.step(&entries);
        self.figures.step_started_ms.store(0, Ordering::Relaxed);
        drop(entries);

        let results = match result {
            Ok(r) => r,
            Err(_) if self.check_crash() => return,
            Err(e) => {
                // The header's rule: on failure the host releases the affected sequences.
                tracing::warn!(model = %self.model_id, error = %e, "engine step failed");
                let mut idx: Vec<usize> = plan.iter().map(|(i, _)| *i).collect();
                idx.sort_unstable_by(|a, b| b.cmp(a));
                for i in idx {
                    let r = self.running.swap_remove(i);
                    self.exec.seq_release(r.seq);
                    self.metrics.finished("error");
                    let _ = r.job.events.send(GenEvent::Error(e.clone()));
                }
                return;
            }
        };
        let now = Instant::now();
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        for (&(i, n), sampled) in plan.iter().zip(results) {
            let r = &mut self.running[i];
            if n > 0 && r.fed == 0 {
                // The prompt's first chunk ran: the engine now knows what it took from a cache.
                r.cached = self.exec.seq_cached_tokens(r.seq).map(|c| {
                    let prompt = r.job.prompt.len() as u64;
                    let c = c.min(prompt);
                    self.metrics.prompt_tokens_cached.inc_by(c);
                    self.metrics.prompt_tokens_evaluated.inc_by(prompt - c);
                    c as u32
                });
            }
            r.fed += n;
            if n == 0 {
                r.next = None;
                r.fed_decode += 1;
            }
            let Some(tok) = sampled else { continue };
            if let Some(reason) =
                Self::on_token(&self.shared, &self.metrics, &self.eog, r, tok, now)
            {
                finished.push((i, reason));
            }
        }
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            let r = self.running.swap_remove(i);
            self.finish(r, reason);
        }
    }

    /// Compute the allowed-token masks of the constrained entries that sample in this step,
    /// in parallel across the batch. A grammar that fails ends its request with an error;
    /// returns false when that happened (the caller plans the step again).
    fn compute_masks(&mut self, plan: &[(usize, usize)]) -> bool {
        use rayon::prelude::*;
        // The running sequences that sample in this step and follow a grammar.
        let mut sampling = vec![false; self.running.len()];
        for &(i, n) in plan {
            let r = &self.running[i];
            sampling[i] = r.job.constraint.is_some() && (n == 0 || r.fed + n == r.job.prompt.len());
        }
        let todo: Vec<(usize, &mut Constraint)> = self
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| sampling[*i])
            .filter_map(|(i, r)| r.job.constraint.as_deref_mut().map(|c| (i, c)))
            .collect();
        if todo.is_empty() {
            return true;
        }
        let t = Instant::now();
        let results: Vec<(usize, Result<f64, String>)> = if todo.len() == 1 {
            todo.into_iter()
                .map(|(i, c)| (i, c.compute_mask()))
                .collect()
        } else {
            todo.into_par_iter()
                .map(|(i, c)| (i, c.compute_mask()))
                .collect()
        };
        self.metrics
            .constraint_batch
            .observe(t.elapsed().as_secs_f64());
        let mut failed: Vec<(usize, String)> = Vec::new();
        for (i, r) in results {
            match r {
                Ok(secs) => self.metrics.constraint_mask.observe(secs),
                Err(e) => failed.push((i, e)),
            }
        }
        if failed.is_empty() {
            return true;
        }
        failed.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, e) in failed {
            let r = self.running.swap_remove(i);
            tracing::warn!(model = %self.model_id, seq = r.seq, error = %e, "constrained decoding failed");
            let _ = r.job.events.send(GenEvent::Error(EngineError::internal(e)));
            self.finish(r, FinishReason::Failed);
        }
        false
    }

    /// Handle one sampled token; `Some` when the sequence is done.
    fn on_token(
        shared: &ModelShared,
        metrics: &ModelMetrics,
        eog: &[i32],
        r: &mut Running,
        tok: gantry_engine_abi::SampledToken,
        now: Instant,
    ) -> Option<FinishReason> {
        match r.last_token_at {
            None => metrics.ttft.observe((now - r.job.arrived).as_secs_f64()),
            Some(prev) => metrics.inter_token.observe((now - prev).as_secs_f64()),
        }
        r.first_token_at.get_or_insert(now);
        r.last_token_at = Some(now);
        if eog.contains(&tok.token) {
            return Some(FinishReason::Stop);
        }
        let mut grammar_done = false;
        if let Some(c) = r.job.constraint.as_deref_mut() {
            if let Err(e) = c.consume(tok.token) {
                // The plugin sampled a token outside the mask it was given.
                let _ = r
                    .job
                    .events
                    .send(GenEvent::Error(EngineError::internal(format!(
                        "the engine sampled token {} outside the allowed-token mask ({e})",
                        tok.token
                    ))));
                return Some(FinishReason::Failed);
            }
            grammar_done = c.is_done();
        }
        metrics.generation_tokens.inc();
        let bytes = shared.detokenize(&[tok.token], false).unwrap_or_default();
        let logprob = r.job.logprobs.map(|_| TokenLogprob {
            token: tok.token,
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes: bytes.clone(),
            logprob: tok.logprob,
            top: tok
                .top
                .iter()
                .map(|&(t, lp)| {
                    let b = shared.detokenize(&[t], false).unwrap_or_default();
                    (t, String::from_utf8_lossy(&b).into_owned(), b, lp)
                })
                .collect(),
        });
        let text = r.utf8.push(&bytes);
        let (text, stopped) = match r.stops.push(&text) {
            StopScan::Emit(t) => (t, false),
            StopScan::Stopped(t) => (t, true),
        };
        r.generated += 1;
        let _ = r.job.events.send(GenEvent::Token { text, logprob });
        if stopped || grammar_done {
            return Some(FinishReason::Stop);
        }
        if r.generated >= r.job.max_tokens {
            return Some(FinishReason::Length);
        }
        r.next = Some(tok.token);
        None
    }

    /// Flush held text, report usage, release the sequence.
    fn finish(&mut self, mut r: Running, reason: FinishReason) {
        self.exec.seq_release(r.seq);
        if reason == FinishReason::Failed {
            self.metrics.finished(reason.label());
            return; // the error event was sent
        }
        let tail = r.utf8.finish();
        let mut rest = match r.stops.push(&tail) {
            StopScan::Emit(t) | StopScan::Stopped(t) => t,
        };
        // Held text that never became a stop sequence belongs to the output.
        rest.push_str(&r.stops.finish());
        if !rest.is_empty() {
            let _ = r.job.events.send(GenEvent::Token {
                text: rest,
                logprob: None,
            });
        }
        self.metrics
            .e2e
            .observe(r.job.arrived.elapsed().as_secs_f64());
        self.metrics.finished(reason.label());
        let _ = r.job.events.send(GenEvent::Done {
            reason,
            prompt_tokens: r.job.prompt.len() as u32,
            cached_tokens: r.cached,
            completion_tokens: r.generated,
            queued: r.queued,
        });
    }
}
