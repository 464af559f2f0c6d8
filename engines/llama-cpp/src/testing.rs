//! llama.cpp engine, test support: the real model the in-crate tests load.

use gantry_engine_abi::sdk::{Engine, HostLog};
use gantry_engine_abi::{EngineConfig, Format, ModelDescriptor};

use crate::{LlamaEngine, LlamaLoaded};

/// A loaded model with the engine that loaded it, dropped after it.
pub(crate) struct Loaded {
    pub(crate) model: LlamaLoaded,
    _engine: LlamaEngine,
}

impl std::ops::Deref for Loaded {
    type Target = LlamaLoaded;
    fn deref(&self) -> &LlamaLoaded {
        &self.model
    }
}

/// Gemma loaded on 2 threads with `max_seqs` sequences of `context` tokens each.
pub(crate) fn load_gemma(max_seqs: u32, context: u32) -> Loaded {
    // Gemma 3 270M, whose sliding-window layers attend to the last 512 positions.
    let path = gantry_testkit::gemma_gguf();
    let engine = LlamaEngine::create(
        EngineConfig {
            n_threads: 2,
            max_batch_size: max_seqs,
            context_length: context,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )
    .expect("engine");
    let model = engine
        .load_model(&ModelDescriptor::new("gemma", path.clone(), Format::Gguf))
        .expect("load gemma");
    Loaded {
        model,
        _engine: engine,
    }
}
