//! A model's LoRA adapters in the node config (operator build step → node start-up and reload):
//! the `adapters` list of one `models[]` entry, the OpenAI model id each adapter is served
//! under, and the rules the YAML shape cannot express.
//!
//! ```yaml
//! models:
//!   - id: smollm2
//!     adapters:
//!       - name: pirate                              # served as `smollm2:pirate`
//!         source: hf://org/smollm2-pirate-lora      # or `path:`; the base model's URI grammar
//!         scale: 1.0                                # optional, default 1
//!       - name: legal
//!         path: /models/legal.gguf
//!         servedName: legal-assistant               # served under its own id instead
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::source::{Source, check_relative_file};

/// Most adapters one model may list (the ABI takes any number; this bounds a config's size).
pub const MAX_ADAPTERS: usize = 64;

/// The separator between a base model id and an adapter name in an adapter's model id.
pub const ADAPTER_SEPARATOR: char = ':';

/// One LoRA adapter of a model.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdapterConfig {
    /// Unique within the model: a DNS label (lowercase letters, digits, `-`), at most 63.
    pub name: String,
    /// A local file (a GGUF LoRA) or directory (a PEFT adapter: `adapter_config.json`,
    /// `adapter_model.safetensors`); `path` or `source`, not both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Where the adapter lives, in the base model's URI grammar (`hf://`, `s3://`,
    /// `https://`, `file://`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Files to fetch, relative to the source; empty: what the base model's format needs
    /// (the GGUF file, or the PEFT pair).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
    /// Multiplies the adapter's delta (`alpha / rank` from the adapter is applied on top);
    /// absent = 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f32>,
    /// The OpenAI model id it is served under; absent = `<model id>:<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_name: Option<String>,
}

impl AdapterConfig {
    /// The OpenAI model id of this adapter of model `base`.
    pub fn model_id(&self, base: &str) -> String {
        match &self.served_name {
            Some(s) => s.clone(),
            None => format!("{base}{ADAPTER_SEPARATOR}{}", self.name),
        }
    }

    pub fn scale(&self) -> f32 {
        self.scale.unwrap_or(1.0)
    }

    /// Whether the model store downloads this adapter first.
    pub fn is_remote(&self) -> bool {
        self.path.is_none()
            && self
                .source
                .as_deref()
                .and_then(|s| Source::parse_on_node(s).ok())
                .is_some_and(|s| s.is_remote())
    }

    /// The local path of a `path:` or `file://` adapter; `None` for one the store downloads.
    pub fn local_path(&self) -> Option<PathBuf> {
        if let Some(p) = &self.path {
            return Some(p.clone());
        }
        match Source::parse_on_node(self.source.as_deref()?) {
            Ok(Source::File { path }) => Some(path),
            _ => None,
        }
    }

    /// The first broken rule as (field below `adapters[<name>]`, reason).
    pub fn check(&self) -> Option<(&'static str, String)> {
        if let Err(reason) = check_name(&self.name) {
            return Some(("name", reason));
        }
        match (&self.path, &self.source) {
            (Some(_), Some(_)) => {
                return Some(("source", "give `path` or `source`, not both".into()));
            }
            (None, None) => return Some(("source", "needs `path` or `source`".into())),
            (None, Some(uri)) => {
                if let Err(e) = Source::parse_on_node(uri) {
                    return Some(("source", e.to_string()));
                }
            }
            (Some(_), None) => {}
        }
        for f in &self.files {
            if let Err(reason) = check_relative_file(f) {
                return Some(("files", reason));
            }
        }
        if let Some(s) = self.scale
            && !(s.is_finite() && s > 0.0 && s <= 16.0)
        {
            return Some(("scale", format!("must be within (0, 16], got {s}")));
        }
        if let Some(s) = &self.served_name
            && s.trim().is_empty()
        {
            return Some(("servedName", "must not be empty".into()));
        }
        None
    }
}

/// An adapter name: a DNS label, so that `<model>:<name>` stays a readable model id and the
/// name can label metrics and status entries.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a DNS label (lowercase letters, digits and `-`, at most 63, \
             starting and ending with a letter or digit)"
        ))
    }
}

/// The broken rule of a model's adapter list, as (field, reason), with `field` the full
/// dotted path below `models[<id>]`.
pub fn check_list(adapters: &[AdapterConfig]) -> Option<(String, String)> {
    if adapters.len() > MAX_ADAPTERS {
        return Some((
            "adapters".into(),
            format!("lists {} adapters; at most {MAX_ADAPTERS}", adapters.len()),
        ));
    }
    let mut names = std::collections::HashSet::new();
    for a in adapters {
        if let Some((field, reason)) = a.check() {
            return Some((format!("adapters[{}].{field}", a.name), reason));
        }
        if !names.insert(a.name.as_str()) {
            return Some((format!("adapters[{}].name", a.name), "appears twice".into()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(name: &str) -> AdapterConfig {
        AdapterConfig {
            name: name.into(),
            path: Some("/models/a.gguf".into()),
            ..Default::default()
        }
    }

    #[test]
    fn model_id_is_base_colon_name_unless_served_name_is_set() {
        let mut a = adapter("pirate");
        assert_eq!(a.model_id("smol"), "smol:pirate");
        a.served_name = Some("pirate-bot".into());
        assert_eq!(a.model_id("smol"), "pirate-bot");
    }

    #[test]
    fn rules_name_the_field_and_the_limit() {
        assert_eq!(check_list(&[adapter("pirate")]), None);
        let bad = check_list(&[adapter("Pirate")]).expect("refused");
        assert_eq!(bad.0, "adapters[Pirate].name");
        assert!(bad.1.contains("DNS label"), "{}", bad.1);
        let twice = check_list(&[adapter("a"), adapter("a")]).expect("refused");
        assert_eq!(twice, ("adapters[a].name".into(), "appears twice".into()));
        let mut scaled = adapter("s");
        scaled.scale = Some(0.0);
        assert_eq!(
            check_list(&[scaled]).expect("refused"),
            (
                "adapters[s].scale".into(),
                "must be within (0, 16], got 0".into()
            )
        );
        let mut both = adapter("b");
        both.source = Some("hf://org/repo".into());
        assert_eq!(
            check_list(&[both]).expect("refused").0,
            "adapters[b].source"
        );
        let mut neither = adapter("n");
        neither.path = None;
        assert_eq!(
            check_list(&[neither]).expect("refused").0,
            "adapters[n].source"
        );
        let many: Vec<_> = (0..=MAX_ADAPTERS)
            .map(|i| adapter(&format!("a{i}")))
            .collect();
        assert!(check_list(&many).expect("refused").1.contains("at most 64"));
    }

    #[test]
    fn local_and_remote_sources() {
        let mut a = adapter("x");
        assert_eq!(a.local_path(), Some(PathBuf::from("/models/a.gguf")));
        assert!(!a.is_remote());
        a.path = None;
        a.source = Some("file:///models/x".into());
        assert_eq!(a.local_path(), Some(PathBuf::from("/models/x")));
        a.source = Some("hf://org/lora".into());
        assert_eq!(a.local_path(), None);
        assert!(a.is_remote());
    }
}
