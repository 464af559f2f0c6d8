//! The scheduler thread (one per replica, between the HTTP handlers and the engine): takes
//! jobs, drops the abandoned, admits, steps (`step.rs`), and publishes its figures; a worker
//! crash ends or hands back every job.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use gantry_api::WorkerCrash;
use gantry_engine_abi::{EngineError, Status};

use crate::batch::{self, Capacity, Load, RunningSeq};
use crate::draft::Speculation;
use crate::engine::Engine;
use crate::handle::{Figures, ModelFigures};
use crate::job::{FinishReason, GenError, GenEvent, GenerateJob, Job, Requeue};
use crate::metrics::SchedulerMetrics;
use crate::text_stream::{StopMatcher, Utf8Stream};

/// How a scheduler batches.
#[derive(Clone, Debug)]
pub struct SchedulerSettings {
    /// Prompt tokens one step feeds at most, all prompts together.
    pub prefill_chunk_tokens: usize,
    /// A step longer than this is an overrun (the watchdog acts).
    pub step_timeout: Duration,
    /// Prompt-lookup drafting (used when the engine verifies drafts, ABI 1.5).
    pub speculation: Speculation,
}

/// A sequence in the engine.
pub(crate) struct Running {
    pub(crate) job: GenerateJob,
    pub(crate) seq: u64,
    /// Prompt tokens fed so far.
    pub(crate) fed: usize,
    /// Prompt tokens the engine took from its cache, once its first chunk ran and if it says.
    pub(crate) cached: Option<u32>,
    /// Token to feed next step once decoding.
    pub(crate) next: Option<i32>,
    /// Sampled tokens fed back into the KV cache.
    pub(crate) fed_decode: usize,
    /// Tokens delivered to the client (`usage.completion_tokens`).
    pub(crate) generated: u32,
    pub(crate) utf8: Utf8Stream,
    pub(crate) stops: StopMatcher,
    /// Time from arrival to admission.
    pub(crate) queued: Duration,
    pub(crate) first_token_at: Option<Instant>,
    pub(crate) last_token_at: Option<Instant>,
    /// The prompt's last token waits until the job's forks (`n` > 1) start from the rest.
    pub(crate) hold_last: bool,
    /// Leading positions shared with the sequence this one was forked from (not its own
    /// cells in the admission count).
    pub(crate) shared: usize,
    /// The prompt, then every generated token (the pending one last): what prompt lookup
    /// searches and the draft model catches up with. Empty for a sequence that never drafts.
    pub(crate) context: Vec<i32>,
    /// Its sequence in the draft model's engine, once it drafted with one.
    pub(crate) draft: Option<crate::draft_model::DraftSeq>,
    /// How often its drafted tokens were kept lately (`draft_len.rs`).
    pub(crate) acceptance: crate::draft_len::Acceptance,
    /// The end-of-generation token's log-probability, kept for [`GenEvent::StopLogprob`].
    pub(crate) stop_logprob: Option<f32>,
}

impl Running {
    pub(crate) fn new(job: GenerateJob, seq: u64, queued: Duration, drafts: bool) -> Running {
        let stops = StopMatcher::new(job.stop.clone());
        let context = if drafts {
            job.prompt.clone()
        } else {
            Vec::new()
        };
        Running {
            hold_last: !job.forks.is_empty() && job.prompt.len() >= 2,
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
            shared: 0,
            context,
            draft: None,
            acceptance: crate::draft_len::Acceptance::NONE,
            stop_logprob: None,
        }
    }

    fn kv_tokens(&self) -> u64 {
        (self.fed + self.fed_decode - self.shared) as u64
    }

    /// Positions the sequence holds in the engine.
    pub(crate) fn positions(&self) -> usize {
        self.fed + self.fed_decode
    }

    pub(crate) fn progress(&self) -> RunningSeq {
        RunningSeq {
            prompt_tokens: self.job.prompt.len() - usize::from(self.hold_last),
            fed: self.fed,
            has_next: self.next.is_some(),
            held: self.hold_last,
        }
    }
}

pub(crate) struct Scheduler<E: Engine> {
    pub(crate) engine: E,
    pub(crate) rx: Receiver<Job>,
    pub(crate) waiting: VecDeque<GenerateJob>,
    pub(crate) running: Vec<Running>,
    pub(crate) figures: Arc<Figures>,
    pub(crate) metrics: SchedulerMetrics,
    pub(crate) settings: SchedulerSettings,
    pub(crate) eog: Vec<i32>,
    pub(crate) epoch: Instant,
    pub(crate) capacity: Capacity,
    /// Every replica's figures (this one's among them), which the per-model gauges sum.
    pub(crate) model_figures: Arc<ModelFigures>,
    pub(crate) requeue: Option<Requeue>,
    /// The worker crash that ended this engine instance; every job after it fails at once.
    pub(crate) crashed: Option<WorkerCrash>,
    /// The engine verifies drafts (ABI 1.5 `GANTRY_CAP_SPECULATE`) and drafting is on.
    pub(crate) drafts: bool,
    pub(crate) context_length: usize,
    /// The LoRA adapters loaded into the engine.
    pub(crate) adapters: crate::adapters::Loaded,
    /// The draft model's private instance, when the model drafts with one.
    pub(crate) draft: Option<crate::draft_model::DraftModel>,
    /// The rate of a job's audio (speech recognition).
    pub(crate) audio_rate: u32,
    /// Speech syntheses taking turns between steps (`speech.rs`).
    pub(crate) speeches: VecDeque<crate::speech::Speaking>,
    /// The engine's counters as last read (`counters.rs`).
    pub(crate) counters: crate::counters::Polled,
    /// What steps cost by their size, and how often this model's drafts are kept: what the
    /// drafts' lengths are chosen from (`draft_len.rs`).
    pub(crate) step_costs: crate::draft_len::StepCosts,
    pub(crate) acceptance: crate::draft_len::Acceptance,
}

impl<E: Engine> Scheduler<E> {
    pub(crate) fn run(mut self) {
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
            if !self.speeches.is_empty() {
                self.speak();
                self.publish();
            }
            if self.crashed.is_none() {
                self.counters.poll(&mut self.engine, &self.metrics);
            }
        }
        self.end_speeches(None);
        for r in std::mem::take(&mut self.running) {
            self.engine.seq_release(r.seq);
        }
    }

    /// Take queued jobs; block while idle. Returns false when the channel closed.
    fn intake(&mut self) -> bool {
        if !self.has_work() {
            match self.rx.recv_timeout(Duration::from_millis(250)) {
                Ok(job) => self.accept(job),
                Err(RecvTimeoutError::Timeout) => return true,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(job) => self.accept(job),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return self.has_work(),
            }
        }
    }

    /// Jobs queued, sequences running or speeches in line.
    fn has_work(&self) -> bool {
        !(self.running.is_empty() && self.waiting.is_empty() && self.speeches.is_empty())
    }

    fn accept(&mut self, job: Job) {
        if let Some(crash) = self.crashed.clone() {
            // The worker is gone: nothing here can run this job.
            self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
            match job {
                Job::Generate(g) => self.hand_back(vec![g], &crash),
                Job::Embed(e) => {
                    let _ = e.reply.send(Err(GenError::Crashed(crash)));
                }
                Job::Speech(s) => {
                    let _ = s
                        .events
                        .send(crate::SpeechEvent::Error(GenError::Crashed(crash)));
                }
                Job::Adapter(crate::AdapterJob::Load { reply, .. }) => {
                    let _ = reply.send(Err(GenError::Crashed(crash)));
                }
                Job::Adapter(crate::AdapterJob::Unload { reply, .. }) => {
                    let _ = reply.send(true);
                }
            }
            return;
        }
        match job {
            Job::Generate(g) => self.waiting.push_back(g),
            Job::Embed(e) => {
                // Embeddings run between steps, in arrival order with the rest; a run whose
                // request has ended (nobody waits for the reply) is skipped.
                self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
                if e.reply.is_closed() {
                    return;
                }
                let result = self.engine.embed_batch(&e.inputs);
                let result = result.map_err(|err| self.failure(err));
                let _ = e.reply.send(result);
            }
            Job::Adapter(a) => {
                self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
                self.adapter_job(a);
            }
            Job::Speech(s) => {
                self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
                self.speeches.push_back(crate::speech::Speaking::new(s));
            }
        }
    }

    /// What a failed engine call means for its job: the worker's crash when it died (every
    /// other job is then ended or handed back), else the engine's error.
    pub(crate) fn failure(&mut self, err: EngineError) -> GenError {
        match self.check_crash().then(|| self.crashed.clone()).flatten() {
            Some(crash) => GenError::Crashed(crash),
            None => GenError::Engine(err),
        }
    }

    /// After a failed call: when the worker died, end or hand back every job.
    pub(crate) fn check_crash(&mut self) -> bool {
        if self.crashed.is_some() {
            return true;
        }
        let Some(crash) = self.engine.crashed() else {
            return false;
        };
        self.crashed = Some(crash.clone());
        self.end_speeches(Some(GenError::Crashed(crash.clone())));
        let mut back: Vec<GenerateJob> = Vec::new();
        for r in std::mem::take(&mut self.running) {
            if r.generated == 0 && r.first_token_at.is_none() {
                back.push(r.job);
            } else {
                self.metrics.finished("error");
                let _ = r
                    .job
                    .events
                    .send(GenEvent::Error(GenError::Crashed(crash.clone())));
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
    fn hand_back(&self, jobs: Vec<GenerateJob>, crash: &WorkerCrash) {
        let (retry, fail): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|j| !j.retried);
        let fail_all = |jobs: Vec<GenerateJob>| {
            for j in jobs {
                self.metrics.finished("error");
                j.send_all(GenEvent::Error(GenError::Crashed(crash.clone())));
            }
        };
        fail_all(fail);
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
            None => fail_all(retry),
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
                j.send_all(GenEvent::Done {
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
                self.engine.seq_release(r.seq);
                self.metrics.finished("cancelled");
                tracing::debug!(model = %self.metrics.model, seq = r.seq, "client gone; sequence released");
            } else if r.job.deadline.is_some_and(|d| d <= now) {
                let r = self.running.swap_remove(i);
                self.finish(r, FinishReason::Deadline);
            } else {
                i += 1;
            }
        }
    }

    pub(crate) fn load(&self) -> Load {
        Load {
            sequences: self.running.len(),
            kv_tokens: self.running.iter().map(Running::kv_tokens).sum(),
        }
    }

    /// FIFO admission ([`batch::admissible`]): open a sequence for each head of the queue
    /// that fits; an engine out of memory makes the rest wait, another refusal fails the job.
    fn admit(&mut self) {
        while batch::admissible(
            self.load(),
            self.capacity,
            self.waiting.front().map(|j| j.prompt.len()),
        ) == 1
        {
            let seq = match self.engine.seq_open() {
                Ok(s) => s,
                Err(_) if self.check_crash() => break,
                Err(e) if matches!(e.status, Status::OomVram | Status::OomRam) => break,
                Err(e) => {
                    if let Some(job) = self.waiting.pop_front() {
                        self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
                        self.metrics.finished("error");
                        job.send_all(GenEvent::Error(GenError::Engine(e)));
                    }
                    continue;
                }
            };
            let Some(mut job) = self.waiting.pop_front() else {
                break;
            };
            self.figures.waiting.fetch_sub(1, Ordering::Relaxed);
            if let Err(e) = self
                .set_adapter(seq, &job)
                .and_then(|()| self.set_input(seq, &job))
            {
                self.engine.seq_release(seq);
                self.metrics.finished("error");
                job.send_all(GenEvent::Error(e));
                continue;
            }
            self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
            let queued = job.arrived.elapsed();
            self.metrics.queue_seconds.observe(queued.as_secs_f64());
            if job.prompt.len() < 2 {
                // Nothing to evaluate before the last token: every choice runs on its own.
                let forks = std::mem::take(&mut job.forks);
                self.wait_first(forks);
            }
            let drafts = self.drafts_for(&job);
            self.running.push(Running::new(job, seq, queued, drafts));
        }
    }

    /// Give a just-opened sequence its job's audio (speech recognition).
    pub(crate) fn set_input(&mut self, seq: u64, job: &GenerateJob) -> Result<(), GenError> {
        let Some(audio) = &job.audio else {
            return Ok(());
        };
        let input = gantry_engine_abi::Input::Audio {
            samples: audio,
            sample_rate: self.audio_rate,
            align: job.align,
        };
        self.engine
            .seq_set_input(seq, &input)
            .map_err(|e| self.failure(e))
    }

    /// Whether a job's sequence may draft: the model drafts, and the request neither opted
    /// out nor needs what verification does not do (a grammar's masks, penalties).
    pub(crate) fn drafts_for(&self, job: &GenerateJob) -> bool {
        self.drafts && job.speculate && job.grammar.is_none() && !job.sampling.has_penalties()
    }

    /// Put jobs back at the head of the queue, in order (the choices of an `n` > 1 request
    /// that could not start from its evaluated prompt).
    pub(crate) fn wait_first(&mut self, jobs: Vec<GenerateJob>) {
        self.figures
            .waiting
            .fetch_add(jobs.len() as u64, Ordering::Relaxed);
        for j in jobs.into_iter().rev() {
            self.waiting.push_front(j);
        }
    }

    /// Start the forks of every sequence whose prompt, but for its last token, is evaluated:
    /// each gets a sequence that starts from those cells (ABI 1.5 `seq_fork`) and is fed the
    /// last token itself. Forks beyond the free sequences, or on an engine that cannot fork,
    /// go back to the head of the queue and evaluate their prompt alone.
    pub(crate) fn start_forks(&mut self) {
        let ready: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let r = &self.running[i];
                r.hold_last && r.fed + 1 == r.job.prompt.len()
            })
            .collect();
        for i in ready {
            let forks = std::mem::take(&mut self.running[i].job.forks);
            self.running[i].hold_last = false;
            let (src, fed, cached, queued) = {
                let r = &self.running[i];
                (r.seq, r.fed, r.cached, r.queued)
            };
            let mut rest = Vec::new();
            for job in forks {
                if !rest.is_empty() || self.running.len() >= self.capacity.max_sequences {
                    rest.push(job);
                    continue;
                }
                match self.engine.seq_fork(src) {
                    Ok(seq) => {
                        let drafts = self.drafts_for(&job);
                        let mut r = Running::new(job, seq, queued, drafts);
                        r.hold_last = false;
                        r.fed = fed;
                        r.shared = fed;
                        r.cached = cached;
                        self.running.push(r);
                    }
                    Err(e) => {
                        tracing::debug!(model = %self.metrics.model, error = %e, "no fork; the choice evaluates its prompt alone");
                        rest.push(job);
                    }
                }
            }
            self.wait_first(rest);
        }
    }

    /// Send a job's waiting forks the end their source got (its deadline, its failure).
    pub(crate) fn end_forks(&self, job: &mut GenerateJob, end: &GenEvent) {
        let label = match end {
            GenEvent::Done { reason, .. } => reason.label(),
            _ => "error",
        };
        for f in std::mem::take(&mut job.forks) {
            self.metrics.finished(label);
            let _ = f.events.send(end.clone());
        }
    }

    pub(crate) fn publish(&self) {
        let load = self.load();
        self.figures.running.store(
            (load.sequences + self.speeches.len()) as u64,
            Ordering::Relaxed,
        );
        self.figures
            .kv_used
            .store(load.kv_tokens, Ordering::Relaxed);
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
}
