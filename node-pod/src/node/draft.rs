//! Node lifecycle, a model's draft model (during the model's load, before its schedulers
//! start): node config `speculation: {method: draftModel, draftModel: <id>}` names another
//! model of the node; each replica of the target gets a private instance of the draft's files,
//! loaded by the engine the draft's own entry resolved to, on the replica's devices, and its
//! scheduler drafts with it (`gantry-scheduler`'s `draft_model.rs`).
//!
//! The draft must tokenize exactly as the target: every token id both vocabularies hold must
//! decode to the same bytes, and the draft's vocabulary must not be larger. When the draft
//! cannot serve (not inspected in time, unsupported, failed to load, another tokenizer), the
//! target still loads and decodes without drafts; `/v1/status` says why (`draft.message`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_api::config::SpeculationMethod;
use gantry_api::{DraftStatus, EngineVerdict};

use super::{ModelState, Node, ServedModel};
use crate::engine_host::{ModelExec, ModelShared};

/// How long a model's first load waits for its draft model to be inspected (a download).
const DRAFT_WAIT: Duration = Duration::from_secs(600);

/// The draft instances of a model's replicas, or why it has none.
pub(crate) struct Drafts {
    pub(crate) model: String,
    /// One per replica, in replica order; empty when the draft is not usable.
    pub(crate) instances: Vec<(Arc<ModelShared>, ModelExec)>,
    pub(crate) message: Option<String>,
}

impl Drafts {
    pub(crate) fn status(&self) -> DraftStatus {
        DraftStatus {
            model: self.model.clone(),
            active: !self.instances.is_empty(),
            message: self.message.clone(),
            bytes_used: self
                .instances
                .iter()
                .map(|(s, _)| s.info().bytes_used)
                .sum(),
        }
    }
}

impl Node {
    /// `m`'s draft model, when its config names one: its id, and the model when this node
    /// serves it.
    pub(crate) fn draft_of(&self, m: &ServedModel) -> Option<(String, Option<Arc<ServedModel>>)> {
        let spec = &m.config.speculation;
        if spec.method != SpeculationMethod::DraftModel {
            return None;
        }
        let id = spec.draft_model.clone()?;
        let draft = self.model(&id);
        Some((id, draft))
    }

    /// Before a model's load takes the memory lock: wait (bounded) until its draft model was
    /// inspected, so the load finds its files and engine (a draft still downloading).
    pub(crate) fn wait_for_draft(&self, m: &ServedModel) {
        let Some((_, Some(draft))) = self.draft_of(m) else {
            return;
        };
        let t0 = Instant::now();
        while matches!(draft.state(), ModelState::Pending)
            && !draft.is_retired()
            && t0.elapsed() < DRAFT_WAIT
        {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Load `m`'s draft model once per replica (`placement`), next to `target` (the first
    /// replica's model). `None` when `m` has no draft model.
    pub(crate) fn load_drafts(
        &self,
        m: &ServedModel,
        target: &ModelShared,
        placement: &[Vec<u32>],
    ) -> Option<Drafts> {
        let (id, draft) = self.draft_of(m)?;
        let mut out = Drafts {
            model: id.clone(),
            instances: Vec::new(),
            message: None,
        };
        match self.draft_instances(m, draft.as_deref(), target, placement) {
            Ok(instances) => out.instances = instances,
            Err(why) => {
                tracing::warn!(target: "gantry::alert", model = %m.config.id, draft = %id, "decoding without drafts: {why}");
                out.message = Some(why);
            }
        }
        Some(out)
    }

    fn draft_instances(
        &self,
        m: &ServedModel,
        draft: Option<&ServedModel>,
        target: &ModelShared,
        placement: &[Vec<u32>],
    ) -> Result<Vec<(Arc<ModelShared>, ModelExec)>, String> {
        let draft = draft.ok_or("the draft model is not served by this node")?;
        let plugin_id = match draft.verdict.read().ok().and_then(|v| v.clone()) {
            Some(EngineVerdict::Supported { plugin, .. }) => plugin,
            Some(EngineVerdict::Unsupported { .. }) => {
                return Err("no engine supports the draft model".into());
            }
            None => return Err("the draft model was not inspected in time".into()),
        };
        let primary = draft
            .primary
            .read()
            .ok()
            .and_then(|p| p.clone())
            .ok_or("the draft model's files are not there")?;
        let reg = self.registry_now().ok_or("no engine registry")?;
        let plugin = reg
            .plugin(&plugin_id)
            .ok_or_else(|| format!("the draft model's engine `{plugin_id}` is gone"))?;
        let mut instances = Vec::with_capacity(placement.len());
        for devices in placement {
            let mut desc = super::lifecycle::descriptor(draft, &primary, devices);
            desc.model_id = format!("{} (draft of {})", draft.config.id, m.config.id);
            // It follows every sequence of the target to the target's context.
            desc.max_sequences = target.info().max_sequences;
            desc.context_length = target.info().context_length;
            let (shared, exec) = plugin
                .load_model(&desc)
                .map_err(|e| format!("the draft model failed to load: {e}"))?;
            if instances.is_empty() {
                same_tokenizer(target, &shared)?;
            }
            instances.push((shared, exec));
        }
        Ok(instances)
    }
}

/// Whether `draft` tokenizes as `target`: every id of the draft's vocabulary decodes to the
/// same bytes in both.
fn same_tokenizer(target: &ModelShared, draft: &ModelShared) -> Result<(), String> {
    let (t, d) = (target.info().vocab_size, draft.info().vocab_size);
    if d > t {
        return Err(format!(
            "the draft model's vocabulary ({d} tokens) is larger than the model's ({t})"
        ));
    }
    let ids: Vec<i32> = (0..d as i32).collect();
    let mine = target
        .detokenize_each(&ids, true)
        .map_err(|e| format!("cannot read the model's vocabulary: {e}"))?;
    let theirs = draft
        .detokenize_each(&ids, true)
        .map_err(|e| format!("cannot read the draft model's vocabulary: {e}"))?;
    match ids
        .iter()
        .zip(mine.iter().zip(&theirs))
        .find(|(_, (a, b))| a != b)
    {
        None => Ok(()),
        Some((id, (a, b))) => Err(format!(
            "the draft model tokenizes differently: token {id} is {:?} in the model and {:?} in the draft",
            String::from_utf8_lossy(a),
            String::from_utf8_lossy(b)
        )),
    }
}
