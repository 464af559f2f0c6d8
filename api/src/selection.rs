//! Engine selection (operator resolve step, and the node's engine registry at start-up): which
//! plugin serves a model, by one set of rules that both sides run.
//!
//! The operator chooses which EnginePlugins a Model's node pods mount; the node confirms against
//! the plugins it actually loaded. Both describe their candidates as [`Candidate`]s and call
//! [`select`], so they cannot disagree on the order, the checks or the rejection kinds:
//!
//! - candidates are tried in engine-id order, then by name (no benchmark scores yet);
//! - each is checked pin → refused before selection (ABI, manifest or spec, id conflict, load
//!   failure) → GPU backend → format → modality (when the model names the ones it is for) →
//!   architecture, and the first that passes wins;
//! - a pin is never overridden and there is no fallback to another format or engine;
//! - when nothing passes, every candidate is listed with its reason.
//!
//! The operator may not know the architecture yet (it is read from the artifacts by the node):
//! then every candidate that passes the other rules is returned as pending, and the first node
//! report decides.

use crate::status::{Rejection, RejectionKind};

/// One plugin as the resolving side knows it.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    /// The name rejections carry: the node's plugin id, the operator's EnginePlugin name.
    pub name: &'a str,
    /// The engine id a pin names.
    pub engine_id: &'a str,
    /// Refused before selection (not loaded on the node, not accepted by the operator): the
    /// kind and the full reason.
    pub refused: Option<(RejectionKind, String)>,
    /// `cpu` or `cuda`.
    pub gpu_backend: &'a str,
    pub formats: &'a [String],
    /// What the engine serves (`completion`, `transcription`, ...); empty means `completion`,
    /// as a manifest or EnginePlugin without the field does.
    pub modalities: &'a [String],
    pub architectures: &'a [String],
}

/// What the model needs.
#[derive(Clone, Debug)]
pub struct Wanted<'a> {
    /// `gguf`, `safetensors` or `onnx`.
    pub format: &'a str,
    /// The modalities the model is served for (`Model.spec.modalities`); empty: not checked
    /// (the engine's own report at load decides the routes).
    pub modalities: &'a [String],
    /// `None` while unknown (the operator before the first node report).
    pub architecture: Option<&'a str>,
    /// An engine id the model is pinned to.
    pub pin: Option<&'a str>,
    /// `cpu` or `cuda`.
    pub backend: &'a str,
    /// Said after the backend rejection, e.g. why the model runs on that backend.
    pub backend_note: &'a str,
    /// Where a pinned engine would have to come from, for the rejection when none does
    /// (`installed on this node`, `provided by any EnginePlugin`).
    pub pin_scope: &'a str,
}

/// The outcome, by index into the candidates as given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    /// The architecture is known and this candidate serves it.
    Chosen(usize),
    /// The architecture is unknown; these candidates pass every other rule, in selection order.
    Pending(Vec<usize>),
    /// Nothing can serve the model: every candidate and its reason.
    Rejected(Vec<Rejection>),
}

/// Candidate indices in selection order: engine id, then name.
fn in_order(candidates: &[Candidate<'_>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&candidates[a], &candidates[b]);
        (a.engine_id, a.name).cmp(&(b.engine_id, b.name))
    });
    order
}

/// The rules of this module's header for one candidate: `Ok` when it can serve `want`
/// (whatever the architecture, while `want` does not know it), else the rejection.
fn check(c: &Candidate<'_>, want: &Wanted<'_>) -> Result<(), (RejectionKind, String)> {
    if let Some(pin) = want.pin
        && pin != c.engine_id
    {
        return Err((
            RejectionKind::Pin,
            format!("model is pinned to engine {pin}"),
        ));
    }
    if let Some(refused) = &c.refused {
        return Err(refused.clone());
    }
    if c.gpu_backend != want.backend {
        return Err((
            RejectionKind::Backend,
            format!(
                "plugin is built for {}, the model runs on {}{}",
                c.gpu_backend, want.backend, want.backend_note
            ),
        ));
    }
    if !c.formats.iter().any(|f| f == want.format) {
        return Err((
            RejectionKind::Format,
            format!(
                "format {} not supported (plugin formats: {})",
                want.format,
                c.formats.join(", ")
            ),
        ));
    }
    let serves = |m: &str| match c.modalities {
        [] => m == "completion",
        declared => declared.iter().any(|d| d == m),
    };
    if let Some(m) = want.modalities.iter().find(|m| !serves(m)) {
        let declared = match c.modalities {
            [] => "completion".to_string(),
            d => d.join(", "),
        };
        return Err((
            RejectionKind::Modality,
            format!("modality {m} not served (plugin modalities: {declared})"),
        ));
    }
    match want.architecture {
        Some(arch) if !c.architectures.iter().any(|a| a == arch) => Err((
            RejectionKind::Architecture,
            format!("architecture {arch} is not in the plugin's list"),
        )),
        _ => Ok(()),
    }
}

/// Every candidate that passes every rule for `want`, in selection order, one per engine id
/// (the first in that order): the engines to measure against each other when there are
/// several (the node's engine choice by measurement). [`select`] chooses the first of them.
pub fn passing(candidates: &[Candidate<'_>], want: &Wanted<'_>) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for i in in_order(candidates) {
        let c = &candidates[i];
        if check(c, want).is_ok() && !out.iter().any(|&j| candidates[j].engine_id == c.engine_id) {
            out.push(i);
        }
    }
    out
}

/// Choose among `candidates` for `want`, by the rules in this module's header.
pub fn select(candidates: &[Candidate<'_>], want: &Wanted<'_>) -> Selection {
    let mut rejections = Vec::new();
    let mut passing = Vec::new();
    for i in in_order(candidates) {
        let c = &candidates[i];
        match check(c, want) {
            Err((kind, reason)) => rejections.push(Rejection {
                plugin: c.name.to_string(),
                kind,
                reason,
            }),
            Ok(()) if want.architecture.is_some() => return Selection::Chosen(i),
            Ok(()) => passing.push(i),
        }
    }
    if !passing.is_empty() {
        return Selection::Pending(passing);
    }
    if let Some(pin) = want.pin
        && !candidates.iter().any(|c| c.engine_id == pin)
    {
        rejections.push(Rejection {
            plugin: pin.to_string(),
            kind: RejectionKind::Pin,
            reason: format!("pinned engine {pin} is not {}", want.pin_scope),
        });
    }
    Selection::Rejected(rejections)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// A Llama GGUF model on a CPU node, no pin.
    fn llama_gguf_on_cpu() -> Wanted<'static> {
        Wanted {
            format: "gguf",
            modalities: &[],
            architecture: Some("llama"),
            pin: None,
            backend: "cpu",
            backend_note: "",
            pin_scope: "installed on this node",
        }
    }

    #[test]
    fn the_first_candidate_in_engine_id_order_wins_and_a_pin_is_never_overridden() {
        let (gguf, arch) = (strings(&["gguf"]), strings(&["llama"]));
        let cand = |name, engine_id| Candidate {
            name,
            engine_id,
            refused: None,
            gpu_backend: "cpu",
            formats: &gguf,
            modalities: &[],
            architectures: &arch,
        };
        let candidates = [cand("zeta", "zeta"), cand("alpha", "alpha")];
        let mut want = llama_gguf_on_cpu();
        assert_eq!(select(&candidates, &want), Selection::Chosen(1));
        want.pin = Some("vllm");
        let Selection::Rejected(r) = select(&candidates, &want) else {
            panic!("a pin to a missing engine is never overridden")
        };
        assert_eq!(r.len(), 3);
        assert!(r.iter().all(|r| r.kind == RejectionKind::Pin));
        assert_eq!(
            r[2].reason,
            "pinned engine vllm is not installed on this node"
        );
    }

    #[test]
    fn passing_lists_every_fitting_engine_once_in_selection_order() {
        let (gguf, arch, other) = (strings(&["gguf"]), strings(&["llama"]), strings(&["mamba"]));
        let cand = |name, engine_id, architectures| Candidate {
            name,
            engine_id,
            refused: None,
            gpu_backend: "cpu",
            formats: &gguf,
            modalities: &[],
            architectures,
        };
        let candidates = [
            cand("zeta", "zeta", &arch),
            cand("alpha-b", "alpha", &arch),
            cand("mamba", "mamba", &other),
            cand("alpha-a", "alpha", &arch),
        ];
        let want = llama_gguf_on_cpu();
        assert_eq!(passing(&candidates, &want), vec![3, 0]);
        assert_eq!(select(&candidates, &want), Selection::Chosen(3));
    }

    #[test]
    fn a_model_for_a_modality_goes_to_an_engine_that_serves_it() {
        let (st, whisper) = (
            strings(&["safetensors"]),
            strings(&["WhisperForConditionalGeneration"]),
        );
        let (text, speech) = (
            strings(&["completion", "embedding"]),
            strings(&["transcription"]),
        );
        let cand = |name, modalities| Candidate {
            name,
            engine_id: name,
            refused: None,
            gpu_backend: "cpu",
            formats: &st,
            modalities,
            architectures: &whisper,
        };
        let mut want = Wanted {
            format: "safetensors",
            architecture: Some("WhisperForConditionalGeneration"),
            ..llama_gguf_on_cpu()
        };
        let wants_speech = strings(&["transcription"]);
        want.modalities = &wants_speech;
        // Without the modality: rejected with what it serves, even with the architecture.
        let Selection::Rejected(r) = select(&[cand("a_text", &text), cand("b_none", &[])], &want)
        else {
            panic!("no engine serves transcription")
        };
        assert!(r.iter().all(|r| r.kind == RejectionKind::Modality));
        assert_eq!(
            r[0].reason,
            "modality transcription not served (plugin modalities: completion, embedding)"
        );
        assert!(r[1].reason.ends_with("(plugin modalities: completion)"));
        let three = [
            cand("a_text", &text),
            cand("b_none", &[]),
            cand("c_speech", &speech),
        ];
        assert_eq!(select(&three, &want), Selection::Chosen(2));
        // A model that names none is not checked; one for `completion` passes a plugin that
        // declares nothing.
        want.modalities = &[];
        assert_eq!(select(&three, &want), Selection::Chosen(0));
        let completion = strings(&["completion"]);
        want.modalities = &completion;
        assert_eq!(passing(&three, &want), vec![0, 1]);
    }
}
