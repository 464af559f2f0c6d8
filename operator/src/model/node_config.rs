//! Model reconcile, render step (pure, no client; after validate, before observe): the node
//! config a Model's pods read, rendered once as YAML, and its hash.
//!
//! The hash goes on the pod template (`gantry.dev/config-hash`); the observe step uses it to
//! tell node pods running the current config from pods still rolling out, and the build step
//! puts the YAML into the ConfigMap. It must be known before engine selection, which needs the
//! architecture those current pods report, so nothing here depends on the selected engine.
//!
//! The one engine fact in it is `isolation`: the mode (`spec.isolation`) of every EnginePlugin
//! the pods may mount, keyed by engine id (the plugin manifest's `id`, which the node looks
//! modes up by). "May mount" is selection without the architecture (pin, acceptance, backend,
//! format), a superset of the plugin selection settles on, so the config does not change when
//! the first report names the architecture, and changing a plugin's isolation changes the hash
//! and rolls the pods (the node opens a plugin once, in the mode it started with).

use gantry_api::config::{AdapterConfig, IsolationConfig};
use gantry_api::{ModelConfig, NodeConfig};
use sha2::{Digest, Sha256};

use crate::model::validate::{ValidAdapter, ValidModel};
use gantry_crd::EnginePlugin;
use gantry_crd::names::NODE_CACHE_DIR;

/// The node config of one Model as the node reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderedConfig {
    /// The YAML document, the ConfigMap's only key.
    pub yaml: String,
    /// [`short_hash`] of `yaml`.
    pub hash: String,
}

/// Why the node config could not be rendered. Only serialization can fail, which is a bug, not
/// user input.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("cannot render the node config: {0}")]
    Yaml(#[source] serde_yaml::Error),
}

impl RenderError {
    pub fn metric_label(&self) -> &'static str {
        // Rendering was part of the build step; the label is kept so dashboards keep counting.
        match self {
            RenderError::Yaml(_) => "build_render_config",
        }
    }
}

/// Render `model`'s node config for pods that may mount `plugins` and hash it.
pub fn render(
    model: &ValidModel,
    plugins: &[&EnginePlugin],
) -> Result<RenderedConfig, RenderError> {
    let yaml = serde_yaml::to_string(&node_config(model, plugins)).map_err(RenderError::Yaml)?;
    let hash = short_hash(yaml.as_bytes());
    Ok(RenderedConfig { yaml, hash })
}

/// The node's model config (YAML) for one Model whose pods may mount `plugins`: the node's own
/// type, so the node reads exactly what is rendered here.
pub fn node_config(model: &ValidModel, plugins: &[&EnginePlugin]) -> NodeConfig {
    NodeConfig {
        models: vec![model_config(model)],
        cache_dir: Some(NODE_CACHE_DIR.into()),
        isolation: isolation(plugins),
        ..NodeConfig::default()
    }
}

/// The node's isolation settings for pods that may mount `plugins`: one entry per plugin that
/// sets `spec.isolation`, by engine id; the default stays the node's (`inProcess`), so a config
/// whose plugins set nothing has no `isolation` key at all.
///
/// Engine selection never mounts two plugins with one engine id for one backend, so an engine
/// id names one plugin here; should two ever meet, the first in selection order wins.
pub fn isolation(plugins: &[&EnginePlugin]) -> IsolationConfig {
    let mut config = IsolationConfig::default();
    for p in plugins {
        if let Some(mode) = p.spec.isolation {
            config
                .plugins
                .entry(p.spec.engine_id.clone())
                .or_insert(mode);
        }
    }
    config
}

/// One Model's entry in a node config (a dedicated Model's only one, or a pool member's).
pub fn model_config(model: &ValidModel) -> ModelConfig {
    let positive = |v: Option<i32>| v.and_then(|v| u32::try_from(v).ok());
    ModelConfig {
        id: model.served_name.clone(),
        source: Some(model.source.node_uri.clone()),
        format: model.format.as_str().to_string(),
        quantization: model.source.quantization.clone(),
        files: model.source.files.clone(),
        engine: model.pin.clone(),
        modalities: model.modalities.clone(),
        context_length: positive(model.engine_config.context_length),
        max_batch_size: positive(model.engine_config.max_batch_size),
        threads: positive(model.engine_config.threads),
        // The pod gets `resources.gpus` devices; a model on more than one spreads over
        // all of them (one is the node's default).
        gpus: u32::try_from(model.gpus).ok().filter(|g| *g > 1),
        load: match model.load {
            gantry_crd::LoadPolicy::Eager => gantry_api::LoadPolicy::Eager,
            gantry_crd::LoadPolicy::Lazy => gantry_api::LoadPolicy::Lazy,
        },
        speculation: speculation(model.engine_config.speculation.as_ref()),
        temperature_fallback: model.engine_config.temperature_fallback,
        adapters: model.adapters.iter().map(adapter_config).collect(),
        ..ModelConfig::default()
    }
}

/// One adapter's entry in its model's `adapters`: its source as the base's is given (a
/// `pvc://` claim as the mounted `file:///models/claim/path`), never a credential (the pod's
/// environment carries the base's, which every download uses).
pub fn adapter_config(a: &ValidAdapter) -> AdapterConfig {
    AdapterConfig {
        name: a.name.clone(),
        path: None,
        source: Some(a.node_uri.clone()),
        files: a.files.clone(),
        scale: a.scale,
        served_name: a.served_name.clone(),
    }
}

/// A Model's `engineConfig.speculation` over the node's defaults.
pub(crate) fn speculation(
    s: Option<&gantry_crd::model::Speculation>,
) -> gantry_api::config::SpeculationConfig {
    use gantry_api::config::{SpeculationConfig, SpeculationMethod};
    let mut c = SpeculationConfig::default();
    let Some(s) = s else { return c };
    let set = |field: &mut u32, v: Option<i32>| {
        if let Some(v) = v.and_then(|v| u32::try_from(v).ok()) {
            *field = v;
        }
    };
    c.method = match s.method {
        gantry_crd::model::SpeculationMethod::PromptLookup => SpeculationMethod::PromptLookup,
        gantry_crd::model::SpeculationMethod::DraftModel => SpeculationMethod::DraftModel,
        gantry_crd::model::SpeculationMethod::Off => SpeculationMethod::Off,
    };
    c.draft_model = s.draft_model.clone();
    c.draft_tokens = s.draft_tokens.and_then(|v| u32::try_from(v).ok());
    set(&mut c.ngram_min, s.ngram_min);
    set(&mut c.ngram_max, s.ngram_max);
    set(&mut c.max_batch, s.max_batch);
    if let Some(a) = s.adaptive {
        c.adaptive = a;
    }
    c
}

/// 16 hex digits of sha256: collisions between two versions of one object are not a concern.
pub fn short_hash(bytes: &[u8]) -> String {
    hex::encode(&Sha256::digest(bytes)[..8])
}
