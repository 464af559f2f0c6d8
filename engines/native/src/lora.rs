//! Native engine, LoRA adapters (ABI 1.6; beside the model in `lib.rs`, feeding the backend's
//! forward pass): `adapter_load`, `adapter_unload` and `seq_set_adapter`.
//!
//! Load: a PEFT directory is read and checked against the base model's shapes (`lora/peft.rs`)
//! into f32 low-rank pairs per layer and projection ([`LoraWeights`]), then handed to the
//! backend, which owns them (the CPU backend applies them, `cpu/lora.rs`; the CUDA backend
//! refuses). A refusal leaves nothing allocated and the model serving as before.
//!
//! Step: each sequence runs under one adapter (its [`crate::kv::SeqBlocks::adapter`], 0 = the
//! base model, inherited by a fork). The step turns the batch into runs of consecutive rows
//! under the same adapter ([`AdapterRun`]); after each targeted projection's base product over
//! the whole batch, the backend adds `scale · (x·Aᵀ)·Bᵀ` to the rows of each run only
//! ("segmented LoRA", as in S-LoRA and Punica). A step without adapters has no runs and costs
//! nothing extra. The prefix cache is keyed by the adapter (`kv.rs`), so K/V computed under
//! one adapter is never reused under another.

mod peft;

use std::ops::Range;

use gantry_engine_abi::{AdapterDescriptor, EngineError, Format, LoadedAdapter, LogLevel};

use crate::DecoderModel;
use crate::config::ModelConfig;

/// The projections an adapter may target, by their Hugging Face module names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module name (`q_proj`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// The module's parent in a decoder layer (`self_attn` or `mlp`).
    pub fn parent(self) -> &'static str {
        match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            Target::Gate | Target::Up | Target::Down => "mlp",
        }
    }

    pub fn from_name(name: &str) -> Option<Target> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The base weight's shape `[out, in]` in a model of `cfg` (as `backend::load_stack`
    /// reads it).
    pub fn shape(self, cfg: &ModelConfig) -> [usize; 2] {
        let (h, q, kv, ff) = (
            cfg.hidden,
            cfg.n_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
            cfg.intermediate,
        );
        match self {
            Target::Q => [q, h],
            Target::K | Target::V => [kv, h],
            Target::O => [h, q],
            Target::Gate | Target::Up => [ff, h],
            Target::Down => [h, ff],
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// One projection's low-rank update: `ΔW = scale · B·A`.
pub struct LoraPair {
    pub rank: usize,
    /// Input features (A's columns) and output features (B's rows).
    pub d_in: usize,
    pub d_out: usize,
    /// `[rank, d_in]`, row-major.
    pub a: Vec<f32>,
    /// `[d_out, rank]`, row-major.
    pub b: Vec<f32>,
    /// The descriptor's scale times `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA).
    pub scale: f32,
}

/// An adapter in host memory, f32: per layer, one optional pair per [`Target`].
pub struct LoraWeights {
    /// The host's name, for messages.
    pub name: String,
    pub layers: Vec<[Option<LoraPair>; 7]>,
}

impl LoraWeights {
    /// The f32 bytes held.
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|p| ((p.a.len() + p.b.len()) * 4) as u64)
            .sum()
    }

    pub fn pair(&self, layer: usize, target: Target) -> Option<&LoraPair> {
        self.layers.get(layer)?[target.index()].as_ref()
    }
}

/// Rows `rows` of a step's flattened batch run under `adapter` (never 0: base rows have no
/// run).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterRun {
    pub rows: Range<usize>,
    pub adapter: u64,
}

/// Append rows `rows` under `adapter` to `runs`, merging with the last run when it is the same
/// adapter and ends where these start. Base rows (adapter 0) add nothing.
pub fn push_run(runs: &mut Vec<AdapterRun>, rows: Range<usize>, adapter: u64) {
    if adapter == 0 || rows.is_empty() {
        return;
    }
    if let Some(last) = runs.last_mut()
        && last.adapter == adapter
        && last.rows.end == rows.start
    {
        last.rows.end = rows.end;
        return;
    }
    runs.push(AdapterRun { rows, adapter });
}

impl DecoderModel {
    /// `Model::adapter_load`: see the module header.
    pub(crate) fn load_adapter(
        &self,
        desc: &AdapterDescriptor,
    ) -> Result<LoadedAdapter, EngineError> {
        if desc.format != Format::Safetensors {
            return Err(EngineError::unsupported(format!(
                "adapter {}: the native engine reads PEFT safetensors adapters (adapter_config.json and adapter_model.safetensors), not {}",
                desc.name, desc.format
            )));
        }
        // The backend first: one that cannot run adapters refuses before any file is read.
        self.exec().backend.runs_adapters()?;
        let weights = peft::read(desc, &self.config)?;
        let mut guard = self.exec();
        let ex = &mut *guard;
        let id = ex.next_adapter;
        let name = weights.name.clone();
        let bytes = ex.backend.adapter_load(id, weights)?;
        // Ids are never reused: the prefix cache keys blocks by them.
        ex.next_adapter += 1;
        ex.adapters.insert(id, name.clone());
        self.log.log(
            LogLevel::Info,
            &format!("adapter {name} loaded as {id} ({bytes} bytes)"),
        );
        Ok(LoadedAdapter { id, bytes })
    }

    /// `Model::adapter_unload`.
    pub(crate) fn unload_adapter(&self, adapter: u64) {
        let mut guard = self.exec();
        let ex = &mut *guard;
        let Some(name) = ex.adapters.remove(&adapter) else {
            return;
        };
        let users = ex
            .seqs
            .values()
            .filter(|s| s.blocks.adapter == adapter)
            .count();
        if users > 0 {
            // The host releases them first; a step on one now fails, never runs the base.
            self.log.log(
                LogLevel::Warn,
                &format!("adapter {name} ({adapter}) unloaded while {users} open sequences use it"),
            );
        }
        ex.backend.adapter_unload(adapter);
    }

    /// `Model::seq_set_adapter`.
    pub(crate) fn set_seq_adapter(&self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        let mut guard = self.exec();
        let ex = &mut *guard;
        if adapter != 0 && !ex.adapters.contains_key(&adapter) {
            return Err(EngineError::internal(format!(
                "sequence {seq}: adapter {adapter} is not loaded"
            )));
        }
        let s = ex.seqs.get_mut(&seq).ok_or_else(|| {
            EngineError::internal(format!("seq_set_adapter on unknown sequence {seq}"))
        })?;
        if s.blocks.adapter != adapter && (s.cached.is_some() || s.blocks.len > 0) {
            return Err(EngineError::internal(format!(
                "sequence {seq} has been stepped under adapter {}: its adapter is set before its first step",
                s.blocks.adapter
            )));
        }
        s.blocks.adapter = adapter;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_neighbouring_rows_of_one_adapter_and_skip_the_base() {
        let mut runs = Vec::new();
        for (rows, adapter) in [
            (0..3, 0),
            (3..5, 7),
            (5..6, 7),
            (6..9, 9),
            (9..10, 0),
            (10..12, 7),
        ] {
            push_run(&mut runs, rows, adapter);
        }
        let run = |rows, adapter| AdapterRun { rows, adapter };
        assert_eq!(runs, vec![run(3..6, 7), run(6..9, 9), run(10..12, 7)]);
        // A step without adapters has no runs at all.
        let mut none = Vec::new();
        push_run(&mut none, 0..4, 0);
        assert!(none.is_empty());
    }
}
