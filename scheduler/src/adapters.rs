//! The LoRA adapters of one replica's engine (node adapter table → scheduler → engine): load
//! and unload between steps, and the adapter a freshly admitted sequence runs with (ABI 1.6).
//! A sequence's adapter is set once, before its first step; the engine batches sequences of
//! different adapters (and the base) in one step.

use std::sync::Arc;

use gantry_engine_abi::{EngineError, LoadedAdapter};

use crate::engine::Engine;
use crate::job::{AdapterJob, GenError, GenerateJob};
use crate::run::Scheduler;

/// The adapters loaded into one engine, by name.
pub(crate) type Loaded = std::collections::HashMap<Arc<str>, LoadedAdapter>;

impl<E: Engine> Scheduler<E> {
    /// Run one adapter change (between steps).
    pub(crate) fn adapter_job(&mut self, job: AdapterJob) {
        match job {
            AdapterJob::Load { name, desc, reply } => {
                let result = match self.adapters.get(&name) {
                    Some(loaded) => Ok(*loaded),
                    None => match self.engine.adapter_load(&desc) {
                        Ok(loaded) => {
                            self.adapters.insert(name, loaded);
                            Ok(loaded)
                        }
                        Err(e) => Err(self.failure(e)),
                    },
                };
                let _ = reply.send(result);
            }
            AdapterJob::Unload { name, reply } => {
                let uses = |j: &GenerateJob| j.adapter.as_deref() == Some(&*name);
                let busy = self.running.iter().any(|r| uses(&r.job))
                    || self
                        .waiting
                        .iter()
                        .any(|j| uses(j) || j.forks.iter().any(uses));
                if !busy && let Some(loaded) = self.adapters.remove(&name) {
                    self.engine.adapter_unload(loaded.id);
                }
                let _ = reply.send(!busy);
            }
        }
    }

    /// Point a just-opened sequence at its job's adapter. The node loads an adapter before it
    /// submits a job for it, so a missing one means it was unloaded in between.
    pub(crate) fn set_adapter(&mut self, seq: u64, job: &GenerateJob) -> Result<(), GenError> {
        let Some(name) = &job.adapter else {
            return Ok(());
        };
        let Some(loaded) = self.adapters.get(name) else {
            return Err(GenError::Engine(EngineError::internal(format!(
                "adapter `{name}` is not loaded in this replica"
            ))));
        };
        let id = loaded.id;
        self.engine
            .seq_set_adapter(seq, id)
            .map_err(|e| self.failure(e))
    }
}
