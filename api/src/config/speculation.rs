//! Node config, a model's speculative decoding (read at start and on reload, applied by the
//! model's scheduler): prompt lookup or a draft model, and the ranges their settings keep.

use serde::{Deserialize, Serialize};

/// How a model speculates: drafts are verified in one engine step (ABI 1.5
/// `GANTRY_CAP_SPECULATE`; an engine without it decodes one token per step whatever this says).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct SpeculationConfig {
    /// `promptLookup` (drafts copied from the prompt and the text so far), `draftModel` (drafts
    /// decoded by a smaller model with the same tokenizer) or `off`.
    pub method: SpeculationMethod,
    /// With `draftModel`: the id of another model in this node config. Each replica loads a
    /// private instance of its files next to its own (same devices, same engine choice as the
    /// draft's own entry); the draft model keeps serving under its own id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_model: Option<String>,
    /// Most drafted tokens verified per sequence and step (1-16); unset: 15 for
    /// `promptLookup` (the adaptive choice settles on fewer where fewer pay), 3 for
    /// `draftModel` (each drafted token costs a step of the draft model). See
    /// [`Self::draft_tokens`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_tokens: Option<u32>,
    /// With `promptLookup`: each step verifies as many of a draft's tokens as make the most
    /// tokens per second, chosen from how often the sequence's drafts were kept lately and what
    /// the model's steps measured by size (up to `draftTokens`). `false`: always `draftTokens`
    /// where the lookup finds that many.
    pub adaptive: bool,
    /// The shortest tail of the text whose earlier occurrence proposes a draft (1-8).
    pub ngram_min: u32,
    /// The longest tail tried first (`ngramMin`-8).
    pub ngram_max: u32,
    /// No drafts while more sequences than this decode together (the step is then bound by
    /// compute, which drafts would add to).
    pub max_batch: u32,
}

/// What proposes the drafts.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum SpeculationMethod {
    #[default]
    PromptLookup,
    DraftModel,
    Off,
}

impl Default for SpeculationConfig {
    fn default() -> Self {
        Self {
            method: SpeculationMethod::PromptLookup,
            draft_model: None,
            draft_tokens: None,
            adaptive: true,
            ngram_min: 2,
            ngram_max: 4,
            max_batch: 2,
        }
    }
}

impl SpeculationConfig {
    pub fn is_default(&self) -> bool {
        self == &Self::default()
    }

    /// The most drafted tokens a step verifies per sequence: the setting, or the method's
    /// default. Prompt lookup drafts for free and its drafts are cut per step (`adaptive`), so
    /// its bound is high: copied text verifies 15 tokens in a step that, on llama.cpp's CPU
    /// kernels, costs about 5 decodes. A draft model pays a step of its own per drafted token.
    pub fn draft_tokens(&self) -> u32 {
        match (self.draft_tokens, self.method) {
            (Some(n), _) => n,
            (None, SpeculationMethod::DraftModel) => 3,
            (None, _) => 15,
        }
    }

    /// The first setting out of its range: (field under `speculation`, reason).
    pub fn check(&self) -> Option<(&'static str, String)> {
        let within = |v: u32, lo: u32, hi: u32| (lo..=hi).contains(&v);
        if let Some(n) = self.draft_tokens.filter(|&n| !within(n, 1, 16)) {
            return Some(("draftTokens", format!("must be within [1, 16], got {n}")));
        }
        if !within(self.ngram_min, 1, 8) {
            return Some((
                "ngramMin",
                format!("must be within [1, 8], got {}", self.ngram_min),
            ));
        }
        if !within(self.ngram_max, self.ngram_min, 8) {
            return Some((
                "ngramMax",
                format!(
                    "must be within [ngramMin = {}, 8], got {}",
                    self.ngram_min, self.ngram_max
                ),
            ));
        }
        if self.max_batch == 0 {
            return Some(("maxBatch", "must be >= 1".into()));
        }
        match (&self.method, self.draft_model.as_deref()) {
            (SpeculationMethod::DraftModel, None) => Some((
                "draftModel",
                "must name the draft model's id when method is draftModel".into(),
            )),
            (SpeculationMethod::DraftModel, Some(d)) if d.trim().is_empty() => {
                Some(("draftModel", "must not be empty".into()))
            }
            (SpeculationMethod::PromptLookup | SpeculationMethod::Off, Some(_)) => Some((
                "draftModel",
                "is only read when method is draftModel".into(),
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NodeConfig;

    #[test]
    fn speculation_defaults_to_prompt_lookup_and_its_settings_are_bounded() {
        let yaml = "models:\n  - {id: m, path: /m.gguf, format: gguf}\n";
        let cfg: NodeConfig = serde_yaml::from_str(yaml).expect("parses");
        assert_eq!(cfg.models[0].speculation, SpeculationConfig::default());
        assert_eq!(
            cfg.models[0].speculation.method,
            SpeculationMethod::PromptLookup
        );
        // A draft model the config does not serve is not refused here (the model loads
        // without drafts and says why), so a pool is not taken down by one member.
        let draft = "models:\n  - {id: m, path: /m.gguf, format: gguf, speculation: {method: draftModel, draftModel: d}}\n";
        let cfg: NodeConfig = serde_yaml::from_str(draft).expect("parses");
        cfg.validate()
            .expect("an unknown draft model is the load's business");
        assert_eq!(cfg.models[0].speculation.draft_model.as_deref(), Some("d"));
        // The bound on a draft by method, unless set: prompt lookup's drafts are cut per step.
        assert_eq!(cfg.models[0].speculation.draft_tokens(), 3);
        assert_eq!(SpeculationConfig::default().draft_tokens(), 15);
        assert!(SpeculationConfig::default().adaptive);
        let set = "models:\n  - {id: m, path: /m.gguf, format: gguf, speculation: {draftTokens: 5, adaptive: false}}\n";
        let cfg: NodeConfig = serde_yaml::from_str(set).expect("parses");
        assert_eq!(cfg.models[0].speculation.draft_tokens(), 5);
        assert!(!cfg.models[0].speculation.adaptive);
        let off = "models:\n  - {id: m, path: /m.gguf, format: gguf, speculation: {method: off}}\n";
        let cfg: NodeConfig = serde_yaml::from_str(off).expect("parses");
        assert_eq!(cfg.models[0].speculation.method, SpeculationMethod::Off);
        // Rendered back, a default block is left out and a changed one kept.
        assert!(
            serde_yaml::to_string(&cfg)
                .expect("renders")
                .contains("method: off")
        );
        let cases = [
            (
                "draftTokens: 0",
                "models[m].speculation.draftTokens",
                "within [1, 16], got 0",
            ),
            (
                "draftTokens: 17",
                "models[m].speculation.draftTokens",
                "got 17",
            ),
            (
                "ngramMin: 0",
                "models[m].speculation.ngramMin",
                "within [1, 8], got 0",
            ),
            (
                "{ngramMin: 3, ngramMax: 2}",
                "models[m].speculation.ngramMax",
                "within [ngramMin = 3, 8], got 2",
            ),
            (
                "maxBatch: 0",
                "models[m].speculation.maxBatch",
                "must be >= 1",
            ),
            (
                "method: draftModel",
                "models[m].speculation.draftModel",
                "must name the draft model's id",
            ),
            (
                "{method: draftModel, draftModel: ' '}",
                "models[m].speculation.draftModel",
                "must not be empty",
            ),
            (
                "draftModel: d",
                "models[m].speculation.draftModel",
                "only read when method is draftModel",
            ),
            (
                "{method: draftModel, draftModel: m}",
                "models[m].speculation.draftModel",
                "names the model itself",
            ),
        ];
        for (block, field, reason) in cases {
            let block = if block.starts_with('{') {
                block.to_string()
            } else {
                format!("{{{block}}}")
            };
            let yaml = format!(
                "models:\n  - {{id: m, path: /m.gguf, format: gguf, speculation: {block}}}\n"
            );
            let cfg: NodeConfig = serde_yaml::from_str(&yaml).expect("parses");
            let e = cfg.validate().expect_err(block.as_str()).to_string();
            assert!(e.contains(field) && e.contains(reason), "{block}: {e}");
        }
    }
}
