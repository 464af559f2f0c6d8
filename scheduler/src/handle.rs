//! The HTTP side's handle on a replica's scheduler (HTTP handler → scheduler) and the live
//! figures both sides share (`/v1/status`, the per-model gauges).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;

use gantry_engine_abi::EngineError;

use crate::job::{GenerateJob, Job};

/// Live figures for `/v1/status` and the gauges.
#[derive(Debug, Default)]
pub struct Figures {
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    pub kv_used: AtomicU64,
    /// Start of the step in flight (ms since the scheduler's epoch + 1), 0 when idle.
    pub step_started_ms: AtomicU64,
}

impl Figures {
    /// An engine step (the target's or its draft model's) starts now: the watchdog times it.
    pub(crate) fn step_began(&self, epoch: std::time::Instant) {
        self.step_started_ms
            .store(epoch.elapsed().as_millis() as u64 + 1, Ordering::SeqCst);
    }

    /// The step in flight ended.
    pub(crate) fn step_ended(&self) {
        self.step_started_ms.store(0, Ordering::SeqCst);
    }
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
    pub(crate) tx: Sender<Job>,
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
                Job::Embed(_) | Job::Adapter(_) | Job::Speech(_) => {
                    unreachable!("a generation was sent")
                }
            }
        })
    }
}
