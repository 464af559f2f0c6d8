//! Engine selection (operator resolve step, and the node's engine registry at start-up): which
//! plugin serves a model, by one set of rules that both sides run.
//!
//! The operator chooses which EnginePlugins a Model's node pods mount; the node confirms against
//! the plugins it actually loaded. Both describe their candidates as [`Candidate`]s and call
//! [`select`], so they cannot disagree on the order, the checks or the rejection kinds:
//!
//! - candidates are tried in engine-id order, then by name (no benchmark scores yet);
//! - each is checked pin → refused before selection (ABI, manifest or spec, id conflict, load
//!   failure) → GPU backend → format → architecture, and the first that passes wins;
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
    pub architectures: &'a [String],
}

/// What the model needs.
#[derive(Clone, Debug)]
pub struct Wanted<'a> {
    /// `gguf` or `safetensors`.
    pub format: &'a str,
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

/// Choose among `candidates` for `want`, by the rules in this module's header.
pub fn select(candidates: &[Candidate<'_>], want: &Wanted<'_>) -> Selection {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&candidates[a], &candidates[b]);
        (a.engine_id, a.name).cmp(&(b.engine_id, b.name))
    });
    let mut rejections = Vec::new();
    let mut passing = Vec::new();
    for i in order {
        let c = &candidates[i];
        let mut reject = |kind, reason: String| {
            rejections.push(Rejection {
                plugin: c.name.to_string(),
                kind,
                reason,
            })
        };
        if let Some(pin) = want.pin
            && pin != c.engine_id
        {
            reject(
                RejectionKind::Pin,
                format!("model is pinned to engine {pin}"),
            );
            continue;
        }
        if let Some((kind, reason)) = &c.refused {
            reject(*kind, reason.clone());
            continue;
        }
        if c.gpu_backend != want.backend {
            reject(
                RejectionKind::Backend,
                format!(
                    "plugin is built for {}, the model runs on {}{}",
                    c.gpu_backend, want.backend, want.backend_note
                ),
            );
            continue;
        }
        if !c.formats.iter().any(|f| f == want.format) {
            reject(
                RejectionKind::Format,
                format!(
                    "format {} not supported (plugin formats: {})",
                    want.format,
                    c.formats.join(", ")
                ),
            );
            continue;
        }
        match want.architecture {
            Some(arch) if !c.architectures.iter().any(|a| a == arch) => reject(
                RejectionKind::Architecture,
                format!("architecture {arch} is not in the plugin's list"),
            ),
            Some(_) => return Selection::Chosen(i),
            None => passing.push(i),
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

    #[test]
    fn the_first_candidate_in_engine_id_order_wins_and_a_pin_is_never_overridden() {
        let (gguf, arch) = (strings(&["gguf"]), strings(&["llama"]));
        let cand = |name, engine_id| Candidate {
            name,
            engine_id,
            refused: None,
            gpu_backend: "cpu",
            formats: &gguf,
            architectures: &arch,
        };
        let candidates = [cand("zeta", "zeta"), cand("alpha", "alpha")];
        let mut want = Wanted {
            format: "gguf",
            architecture: Some("llama"),
            pin: None,
            backend: "cpu",
            backend_note: "",
            pin_scope: "installed on this node",
        };
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
}
