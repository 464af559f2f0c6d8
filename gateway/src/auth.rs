//! API keys (first step of every gateway request when auth is on): who is calling and which
//! models that key may use.
//!
//! Key set format, the same in a Secret and in `--api-keys-file`: one entry per key name, whose
//! value is YAML or JSON `{key: "<secret>", models: ["<id>", ...]}`; `models` absent or empty
//! means every model. In a Secret each `data` key is a key name and its value that document;
//! the file is a YAML map from key name to the same document. Keys are compared as SHA-256
//! digests with a constant-time equality over every entry, so the time taken says nothing about
//! which key, or how much of one, matched.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// One key as written in the Secret or file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyEntry {
    pub key: String,
    #[serde(default)]
    pub models: Vec<String>,
}

/// Why a key set could not be read.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("cannot read API keys file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("API keys file {path} is not a map of name -> {{key, models}}: {source}")]
    ParseFile {
        path: PathBuf,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("API keys Secret entry `{name}` is not {{key, models}}: {source}")]
    ParseEntry {
        name: String,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("API key entry `{0}` has an empty key")]
    EmptyKey(String),
    #[error("cannot read API keys Secret {namespace}/{name}: {source}")]
    Get {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// A key that matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    /// `None`: every model.
    pub models: Option<HashSet<String>>,
}

impl Caller {
    pub fn may_use(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.contains(model))
    }
}

#[derive(Debug)]
struct Stored {
    digest: [u8; 32],
    caller: Caller,
}

/// The current key set. Empty until first loaded: every request is refused then (fail closed).
#[derive(Debug, Default)]
pub struct ApiKeys {
    keys: RwLock<Arc<Vec<Stored>>>,
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Parse a key-set YAML file's text (map of key name → entry).
pub fn parse_file(
    path: &std::path::Path,
    text: &str,
) -> Result<Vec<(String, KeyEntry)>, KeysError> {
    let map: BTreeMap<String, KeyEntry> =
        serde_yaml::from_str(text).map_err(|source| KeysError::ParseFile {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(map.into_iter().collect())
}

/// Parse a Secret's data (key name → YAML/JSON entry).
pub fn parse_secret(secret: &Secret) -> Result<Vec<(String, KeyEntry)>, KeysError> {
    let mut out = Vec::new();
    for (name, value) in secret.data.iter().flatten() {
        let entry: KeyEntry =
            serde_yaml::from_slice(&value.0).map_err(|source| KeysError::ParseEntry {
                name: name.clone(),
                source,
            })?;
        out.push((name.clone(), entry));
    }
    Ok(out)
}

impl ApiKeys {
    /// Replace the key set.
    pub fn set(&self, entries: Vec<(String, KeyEntry)>) -> Result<(), KeysError> {
        let mut stored = Vec::with_capacity(entries.len());
        for (name, e) in entries {
            if e.key.is_empty() {
                return Err(KeysError::EmptyKey(name));
            }
            stored.push(Stored {
                digest: digest(&e.key),
                caller: Caller {
                    name,
                    models: (!e.models.is_empty()).then(|| e.models.into_iter().collect()),
                },
            });
        }
        match self.keys.write() {
            Ok(mut k) => *k = Arc::new(stored),
            Err(e) => *e.into_inner() = Arc::new(stored),
        }
        Ok(())
    }

    /// The caller a presented key belongs to. Every entry is compared, matched or not.
    pub fn check(&self, presented: &str) -> Option<Caller> {
        let keys = self
            .keys
            .read()
            .map(|k| k.clone())
            .unwrap_or_else(|e| e.into_inner().clone());
        let d = digest(presented);
        let mut found = None;
        for s in keys.iter() {
            if bool::from(s.digest.ct_eq(&d)) {
                found = Some(s.caller.clone());
            }
        }
        found
    }
}

/// Where keys come from.
#[derive(Clone, Debug)]
pub enum KeySource {
    File(PathBuf),
    Secret { namespace: String, name: String },
}

/// How often the key source is re-read.
pub const KEYS_REFRESH: Duration = Duration::from_secs(10);

/// Load once (an error here stops start-up: a typo must not serve without auth), then keep
/// re-reading; a later bad read keeps the last good set and logs why.
pub async fn load(
    keys: &ApiKeys,
    source: &KeySource,
    client: Option<&kube::Client>,
) -> Result<(), KeysError> {
    let entries = match source {
        KeySource::File(path) => {
            let text =
                tokio::fs::read_to_string(path)
                    .await
                    .map_err(|source| KeysError::ReadFile {
                        path: path.clone(),
                        source,
                    })?;
            parse_file(path, &text)?
        }
        KeySource::Secret { namespace, name } => {
            let Some(client) = client else {
                return Ok(());
            };
            let api = Api::<Secret>::namespaced(client.clone(), namespace);
            let secret = api.get(name).await.map_err(|source| KeysError::Get {
                namespace: namespace.clone(),
                name: name.clone(),
                source,
            })?;
            parse_secret(&secret)?
        }
    };
    keys.set(entries)
}

/// Re-read the key source every [`KEYS_REFRESH`] forever.
pub async fn refresh(keys: Arc<ApiKeys>, source: KeySource, client: Option<kube::Client>) {
    let mut tick = tokio::time::interval(KEYS_REFRESH);
    tick.tick().await;
    loop {
        tick.tick().await;
        if let Err(e) = load(&keys, &source, client.as_ref()).await {
            tracing::warn!(error = %e, "API keys not refreshed; keeping the last good set");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_exactly_and_carry_their_models() {
        let keys = ApiKeys::default();
        let text = "alice: {key: sk-alice, models: [tiny]}\nbob:\n  key: sk-bob\n";
        keys.set(parse_file(std::path::Path::new("k.yaml"), text).expect("parse"))
            .expect("set");
        let alice = keys.check("sk-alice").expect("alice");
        assert!(alice.may_use("tiny") && !alice.may_use("other"));
        assert!(keys.check("sk-bob").expect("bob").may_use("anything"));
        assert_eq!(keys.check("sk-alic"), None);
        assert_eq!(keys.check(""), None);
    }

    #[test]
    fn a_secret_entry_with_an_unknown_field_is_refused_with_its_name() {
        let s = Secret {
            data: Some(
                [(
                    "ci".to_string(),
                    k8s_openapi::ByteString(b"{key: x, model: [a]}".to_vec()),
                )]
                .into_iter()
                .collect(),
            ),
            ..Secret::default()
        };
        let e = parse_secret(&s).expect_err("unknown field");
        assert!(e.to_string().contains("`ci`"), "{e}");
    }
}
