//! A loaded model's replicas (node lifecycle → scheduler): each replica is one engine instance
//! from the engine host, driven by its own scheduler thread through [`PluginEngine`], the
//! scheduler's narrow engine trait over a plugin's model.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use gantry_api::WorkerCrash;
use gantry_engine_abi::{AdapterDescriptor, EngineError, LoadedAdapter, SampledToken, StepEntry};
use gantry_scheduler::{
    AdapterJob, Engine, EngineLimits, GenError, GenerateJob, Job, ModelFigures, Overrun,
    SchedulerHandle,
};

use crate::engine_host::{ModelExec, ModelShared};

/// A plugin's loaded model (in process or in its worker), as the scheduler drives it.
pub struct PluginEngine(pub ModelExec);

impl Engine for PluginEngine {
    fn limits(&self) -> EngineLimits {
        let info = self.0.shared().info();
        EngineLimits {
            max_sequences: info.max_sequences as usize,
            kv_capacity_tokens: info.kv_capacity_tokens,
            context_length: info.context_length,
            eog_tokens: info.eog_tokens.clone(),
            // A recurrent state cannot be cut back past rejected drafts (ABI 1.7).
            speculation: self.0.shared().supports_speculation() && !info.has_recurrent_state(),
            audio_sample_rate: info.audio_sample_rate,
        }
    }
    fn seq_open(&mut self) -> Result<u64, EngineError> {
        self.0.seq_open()
    }
    fn seq_release(&mut self, seq: u64) {
        self.0.seq_release(seq)
    }
    fn step(
        &mut self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        self.0.step(entries)
    }
    fn seq_cached_tokens(&mut self, seq: u64) -> Option<u64> {
        self.0.seq_cached_tokens(seq)
    }
    fn seq_fork(&mut self, src: u64) -> Result<u64, EngineError> {
        self.0.seq_fork(src)
    }
    fn seq_truncate(&mut self, seq: u64, n_keep: u64) -> Result<(), EngineError> {
        self.0.seq_truncate(seq, n_keep)
    }
    fn adapter_load(&mut self, desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        self.0.adapter_load(desc)
    }
    fn adapter_unload(&mut self, adapter: u64) {
        self.0.adapter_unload(adapter)
    }
    fn seq_set_adapter(&mut self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        self.0.seq_set_adapter(seq, adapter)
    }

    fn seq_set_input(
        &mut self,
        seq: u64,
        input: &gantry_engine_abi::Input<'_>,
    ) -> Result<(), EngineError> {
        self.0.seq_set_input(seq, input)
    }
    fn speech_open(
        &mut self,
        req: &gantry_engine_abi::SpeechRequest<'_>,
    ) -> Result<u64, EngineError> {
        self.0.speech_open(req)
    }
    fn speech_next(&mut self, speech: u64) -> Result<gantry_engine_abi::SpeechPiece, EngineError> {
        self.0.speech_next(speech)
    }
    fn seq_token_times(&mut self, seq: u64, first: usize) -> Result<Vec<f32>, EngineError> {
        self.0.seq_token_times(seq, first)
    }

    fn seq_token_prob(&mut self, seq: u64, n_fed: usize, token: i32) -> Result<f32, EngineError> {
        self.0.seq_token_prob(seq, n_fed, token)
    }

    fn speech_close(&mut self, speech: u64) {
        self.0.speech_close(speech)
    }

    fn counters(&mut self) -> Vec<(String, u64)> {
        // A failed read leaves the series where they were; the next read tries again.
        self.0.counters().unwrap_or_default()
    }
    fn embed_batch(&mut self, inputs: &[Vec<i32>]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.0.embed_batch(inputs)
    }
    fn token_bytes(&self, token: i32) -> Vec<u8> {
        self.0
            .shared()
            .detokenize(&[token], false)
            .unwrap_or_default()
    }
    fn crashed(&self) -> Option<WorkerCrash> {
        self.0.crashed()
    }
    fn on_overrun(&self) -> Overrun {
        match self.0.worker() {
            None => Overrun::MarkHung,
            Some(w) => {
                let w = Arc::downgrade(&w);
                Overrun::Kill(Box::new(move || {
                    let w = w.upgrade()?;
                    w.kill_hung();
                    Some(w.pid())
                }))
            }
        }
    }
}

/// One engine instance of a model (a replica) and its scheduler.
pub struct EngineReplica {
    pub scheduler: SchedulerHandle,
    pub shared: Arc<ModelShared>,
    /// Its private draft model instance (speculative decoding), whose engine its scheduler
    /// owns; kept here for what it holds.
    pub draft: Option<Arc<ModelShared>>,
}

/// Every replica of a loaded model (seed 001: replicas with round-robin): each request
/// goes to the next replica in turn. One replica is the common case; its behaviour is
/// exactly a single scheduler's.
pub struct EngineReplicas {
    replicas: Vec<EngineReplica>,
    next: AtomicU64,
    pub figures: Arc<ModelFigures>,
    /// The LoRA adapters loaded into every replica, by name, with what they hold in all.
    adapters: std::sync::Mutex<std::collections::HashMap<Arc<str>, u64>>,
}

impl EngineReplicas {
    /// A model has at least one replica; an empty list is refused.
    pub fn new(
        replicas: Vec<EngineReplica>,
        figures: Arc<ModelFigures>,
    ) -> Result<Self, EngineError> {
        if replicas.is_empty() {
            return Err(EngineError::internal("a model needs at least one replica"));
        }
        Ok(Self {
            replicas,
            next: AtomicU64::new(0),
            figures,
            adapters: Default::default(),
        })
    }

    fn loaded_adapters(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<Arc<str>, u64>> {
        self.adapters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What adapter `name` holds in all replicas, when every replica has it loaded.
    pub fn adapter_bytes(&self, name: &str) -> Option<u64> {
        self.loaded_adapters().get(name).copied()
    }

    /// The adapters loaded now.
    pub fn adapter_names(&self) -> Vec<Arc<str>> {
        self.loaded_adapters().keys().cloned().collect()
    }

    /// Load adapter `name` into every replica (each scheduler runs it between two steps); what
    /// it holds in all. A replica that refuses it leaves none holding it.
    pub async fn load_adapter(
        &self,
        name: &Arc<str>,
        desc: &gantry_engine_abi::AdapterDescriptor,
    ) -> Result<u64, GenError> {
        let mut total = 0;
        let mut done = Vec::new();
        for r in &self.replicas {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let job = Job::Adapter(AdapterJob::Load {
                name: name.clone(),
                desc: desc.clone(),
                reply: tx,
            });
            let result = match r.scheduler.submit(job) {
                Ok(()) => rx.await.unwrap_or_else(|_| {
                    Err(GenError::Engine(EngineError::internal(
                        "the model's scheduler stopped during the adapter load",
                    )))
                }),
                Err(e) => Err(GenError::Engine(e)),
            };
            match result {
                Ok(loaded) => {
                    total += loaded.bytes;
                    done.push(r);
                }
                Err(e) => {
                    for r in done {
                        let _ = unload_one(r, name).await;
                    }
                    return Err(e);
                }
            }
        }
        self.loaded_adapters().insert(name.clone(), total);
        Ok(total)
    }

    /// Unload adapter `name` from every replica; `false` (and nothing unloaded where it is
    /// busy) while a queued or running sequence uses it.
    pub async fn unload_adapter(&self, name: &Arc<str>) -> bool {
        let mut all = true;
        for r in &self.replicas {
            all &= unload_one(r, name).await;
        }
        if all {
            self.loaded_adapters().remove(name);
        }
        all
    }

    fn next(&self) -> &SchedulerHandle {
        let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % self.replicas.len();
        &self.replicas[i].scheduler
    }

    /// Queue a job on the next replica in turn.
    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        self.next().submit(job)
    }

    /// [`EngineReplicas::submit`] for a generation, with the job back when the scheduler is gone.
    pub fn submit_or_return(&self, job: GenerateJob) -> Result<(), Box<GenerateJob>> {
        self.next().submit_or_return(job)
    }

    /// Per-sequence context: the same on every replica (one config).
    pub fn context_length(&self) -> u32 {
        self.replicas[0].scheduler.context_length
    }

    /// What the engines report holding, all replicas together, their adapters and draft
    /// model instances included.
    pub fn bytes_used(&self) -> u64 {
        let adapters: u64 = self.loaded_adapters().values().sum();
        self.replicas
            .iter()
            .map(|r| {
                r.shared.info().bytes_used + r.draft.as_ref().map_or(0, |d| d.info().bytes_used)
            })
            .sum::<u64>()
            + adapters
    }

    /// Nothing queued or running on any replica.
    pub fn idle(&self) -> bool {
        self.figures.waiting() == 0 && self.figures.running() == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &EngineReplica> {
        self.replicas.iter()
    }

    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }
}

/// Unload an adapter from one replica's engine; `false` while it is in use there.
async fn unload_one(r: &EngineReplica, name: &Arc<str>) -> bool {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job = Job::Adapter(AdapterJob::Unload {
        name: name.clone(),
        reply: tx,
    });
    match r.scheduler.submit(job) {
        Ok(()) => rx.await.unwrap_or(true),
        Err(_) => true, // a stopped scheduler holds nothing
    }
}
