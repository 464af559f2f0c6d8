//! Model reconcile, status step (pure part): `status.draft`, where the Model's draft model
//! (`spec.engineConfig.speculation.draftModel`) stands, from the `draft` block the node pods on
//! the current config report for the Model (`models[].draft` of `/v1/status`).
//!
//! Only ready pods count (they report the Model loaded: the draft is loaded with it). A ready
//! pod that decodes without its draft names itself and its reason in `message`; nothing here
//! changes unless a report does.

use gantry_api::LoadState;

use super::facts::Facts;
use gantry_crd::DraftStatus;

/// The draft model's status, when the Model drafts with one.
pub(super) fn fold_draft(f: &Facts<'_>) -> Option<DraftStatus> {
    let model = f
        .valid
        .engine_config
        .speculation
        .as_ref()
        .filter(|s| s.method == gantry_crd::model::SpeculationMethod::DraftModel)?
        .draft_model
        .clone()?;
    let ready: Vec<_> = f
        .reports
        .iter()
        .filter_map(|r| Some((r, r.model(&f.valid.served_name)?)))
        .filter(|(_, m)| m.load.state == LoadState::Loaded)
        .collect();
    let active = ready
        .iter()
        .filter(|(_, m)| m.draft.as_ref().is_some_and(|d| d.active))
        .count();
    let message = ready.iter().find_map(|(r, m)| {
        let why = match &m.draft {
            Some(d) if d.active => return None,
            Some(d) => d.message.clone().unwrap_or_else(|| "no draft".into()),
            None => "the node reports no draft model".into(),
        };
        Some(format!("node pod {} decodes without drafts: {why}", r.pod))
    });
    Some(DraftStatus {
        model,
        active_replicas: i32::try_from(active).unwrap_or(i32::MAX),
        ready_replicas: i32::try_from(ready.len()).unwrap_or(i32::MAX),
        message,
    })
}
