//! Static endpoint source (discovery without Kubernetes, feeds the routing table): a YAML file
//! mapping model ids to node base URLs, re-read when its content changes.
//!
//! ```yaml
//! models:
//!   tiny: ["http://127.0.0.1:8081", "http://127.0.0.1:8082"]
//!   cold:                       # the long form
//!     endpoints: ["http://127.0.0.1:8083"]
//!     minReplicas: 0            # held while no endpoint is ready (scale from zero)
//!     maxReplicas: 1
//! ```
//!
//! Listed endpoints are not trusted: each starts down until the prober's `/v1/status` says
//! ready (the same answer as the node's `/readyz`). With `--node-token`, the gateway sends that
//! install token itself (not a derived one: there is no Model here) to every listed node, so
//! nodes started by hand run with the same `GANTRY_NODE_TOKEN`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::route_table::{ModelSpec, RouteTable};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointsFile {
    models: BTreeMap<String, Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Entry {
    Urls(Vec<String>),
    Full(FullEntry),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FullEntry {
    #[serde(default)]
    endpoints: Vec<String>,
    #[serde(default = "one")]
    min_replicas: i32,
    #[serde(default = "one")]
    max_replicas: i32,
}

fn one() -> i32 {
    1
}

#[derive(Debug, thiserror::Error)]
pub enum EndpointsFileError {
    #[error("cannot read endpoints file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("endpoints file {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_yaml::Error,
    },
    #[error(
        "endpoints file {path}: model `{model}` endpoint `{url}` must start with http:// or https://"
    )]
    BadUrl {
        path: PathBuf,
        model: String,
        url: String,
    },
}

/// Parse the file's text into model specs.
pub fn parse(path: &Path, text: &str) -> Result<Vec<ModelSpec>, EndpointsFileError> {
    let loaded_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let file: EndpointsFile =
        serde_yaml::from_str(text).map_err(|source| EndpointsFileError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
    let mut specs = Vec::with_capacity(file.models.len());
    for (id, entry) in file.models {
        let full = match entry {
            Entry::Urls(endpoints) => FullEntry {
                endpoints,
                min_replicas: 1,
                max_replicas: 1,
            },
            Entry::Full(f) => f,
        };
        let mut endpoints = Vec::with_capacity(full.endpoints.len());
        for url in full.endpoints {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(EndpointsFileError::BadUrl {
                    path: path.to_path_buf(),
                    model: id,
                    url,
                });
            }
            endpoints.push((url.trim_end_matches('/').to_string(), true));
        }
        specs.push(ModelSpec {
            id,
            endpoints,
            min_replicas: full.min_replicas,
            max_replicas: full.max_replicas,
            failed: false,
            target: None,
            created: loaded_at,
            // The route table's default: the gateway's install token, sent as is.
            node_token: None,
            // The nodes' reports say which adapters they serve.
            adapters: Vec::new(),
        });
    }
    Ok(specs)
}

async fn read(path: &Path) -> Result<String, EndpointsFileError> {
    tokio::fs::read_to_string(path)
        .await
        .map_err(|source| EndpointsFileError::Read {
            path: path.to_path_buf(),
            source,
        })
}

/// Load the file once (an error stops start-up).
pub async fn load(path: &Path, table: &RouteTable) -> Result<String, EndpointsFileError> {
    let text = read(path).await?;
    table.replace(parse(path, &text)?);
    Ok(text)
}

/// Re-read the file every `every`; apply it when its content changed and parses. A broken
/// edit keeps the last good table and logs why.
pub async fn watch(path: PathBuf, table: Arc<RouteTable>, mut last: String, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let text = match read(&path).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "endpoints file");
                continue;
            }
        };
        if text == last {
            continue;
        }
        match parse(&path, &text) {
            Ok(specs) => {
                tracing::info!(models = specs.len(), "endpoints file changed");
                table.replace(specs);
                last = text;
            }
            Err(e) => tracing::warn!(error = %e, "endpoints file change ignored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_long_forms_parse() {
        let text =
            "models:\n  a: [\"http://x:1/\"]\n  b: {endpoints: [\"http://y:2\"], minReplicas: 0}\n";
        let specs = parse(Path::new("e.yaml"), text).expect("parse");
        assert_eq!(specs[0].endpoints, vec![("http://x:1".to_string(), true)]);
        assert_eq!((specs[1].min_replicas, specs[1].max_replicas), (0, 1));
    }

    #[test]
    fn a_url_without_scheme_is_refused_naming_the_model() {
        let e = parse(Path::new("e.yaml"), "models:\n  a: [\"x:1\"]\n").expect_err("bad url");
        assert!(e.to_string().contains("model `a`"), "{e}");
    }
}
