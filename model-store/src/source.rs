//! Model store, step 1 (before any request, at node start): where a model's artifacts live.
//!
//! The URI grammar itself is shared with the operator (`gantry_api::source`); this module adds
//! what only the node does with a source: where its files go in the cache, and the
//! endpoints and credentials each kind needs, read from the standard
//! environment variables (`HF_ENDPOINT`, `HF_TOKEN`, `HF_TOKEN_PATH`,
//! `GANTRY_SOURCE_TOKEN`, `AWS_*`) or set explicitly.

use std::path::PathBuf;

pub use gantry_api::source::Source;
use gantry_api::source::SourceError;

use super::StoreError;

impl From<SourceError> for StoreError {
    fn from(e: SourceError) -> Self {
        StoreError::Source {
            uri: e.uri,
            reason: e.reason,
        }
    }
}

/// The cache directory for a source, relative to the cache root. Each part is sanitized so
/// that no source can name a path outside it.
pub fn cache_subdir(source: &Source) -> PathBuf {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '-'
                }
            })
            .collect::<String>()
            .trim_start_matches('.')
            .to_string()
    };
    match source {
        Source::Hf { repo, revision, .. } => PathBuf::from("hf")
            .join(clean(&repo.replace('/', "--")))
            .join(clean(&revision.replace('/', "--"))),
        Source::S3 { bucket, prefix } => {
            let mut p = PathBuf::from("s3").join(clean(bucket));
            for seg in prefix.split('/').filter(|s| !s.is_empty()) {
                p.push(clean(seg));
            }
            p
        }
        Source::Https { url } => {
            let mut p = PathBuf::from("https").join(clean(url.host_str().unwrap_or("host")));
            if let Some(port) = url.port() {
                p = p.with_file_name(format!(
                    "{}-{port}",
                    clean(url.host_str().unwrap_or("host"))
                ));
            }
            for seg in url.path().split('/').filter(|s| !s.is_empty()) {
                p.push(clean(seg));
            }
            p
        }
        // A node never parses a `pvc://` source (`Source::parse_on_node`); the claim's
        // mount is where it would be.
        Source::File { path } => path.clone(),
        Source::Pvc { claim, path } => PathBuf::from(gantry_api::source::PVC_MOUNT_DIR)
            .join(clean(claim))
            .join(path),
    }
}

/// Endpoints and credentials for the remote sources.
#[derive(Clone, Default)]
pub struct SourceSettings {
    /// Hugging Face endpoint (`HF_ENDPOINT`, default `https://huggingface.co`).
    pub hf_endpoint: Option<String>,
    /// Bearer token for `hf://` and `https://` (`GANTRY_SOURCE_TOKEN`, then
    /// `HF_TOKEN`, then the file at `HF_TOKEN_PATH`).
    pub token: Option<String>,
    /// S3 endpoint (`AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`, default AWS).
    pub s3_endpoint: Option<String>,
    /// S3 region (`AWS_REGION`/`AWS_DEFAULT_REGION`, default `us-east-1`).
    pub s3_region: Option<String>,
    pub aws_access_key_id: Option<String>,
    pub aws_secret_access_key: Option<String>,
    pub aws_session_token: Option<String>,
}

impl std::fmt::Debug for SourceSettings {
    // Credentials never reach a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceSettings")
            .field("hf_endpoint", &self.hf_endpoint)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("s3_endpoint", &self.s3_endpoint)
            .field("s3_region", &self.s3_region)
            .field(
                "aws_access_key_id",
                &self.aws_access_key_id.as_ref().map(|_| "<set>"),
            )
            .finish()
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

impl SourceSettings {
    /// Read the standard environment variables. A token file that is named
    /// but unreadable is an error, not a silent anonymous download.
    pub fn from_env() -> Result<Self, StoreError> {
        let token = match env("GANTRY_SOURCE_TOKEN").or_else(|| env("HF_TOKEN")) {
            Some(t) => Some(t),
            None => match env("HF_TOKEN_PATH") {
                Some(path) => {
                    let t = std::fs::read_to_string(&path).map_err(|e| StoreError::Source {
                        uri: format!("HF_TOKEN_PATH={path}"),
                        reason: format!("cannot read the token file: {e}"),
                    })?;
                    Some(t.trim().to_string()).filter(|t| !t.is_empty())
                }
                None => None,
            },
        };
        Ok(Self {
            hf_endpoint: env("HF_ENDPOINT"),
            token,
            s3_endpoint: env("AWS_ENDPOINT_URL_S3").or_else(|| env("AWS_ENDPOINT_URL")),
            s3_region: env("AWS_REGION").or_else(|| env("AWS_DEFAULT_REGION")),
            aws_access_key_id: env("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key: env("AWS_SECRET_ACCESS_KEY"),
            aws_session_token: env("AWS_SESSION_TOKEN"),
        })
    }

    pub fn hf_endpoint(&self) -> &str {
        self.hf_endpoint
            .as_deref()
            .unwrap_or("https://huggingface.co")
            .trim_end_matches('/')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_uris_parse_with_revision_and_quantization() {
        assert_eq!(
            Source::parse_on_node("hf://google/gemma-3-270m").expect("plain"),
            Source::Hf {
                repo: "google/gemma-3-270m".into(),
                revision: "main".into(),
                quantization: None
            }
        );
        assert_eq!(
            Source::parse_on_node("hf://org/repo@v1.0:Q4_K_M").expect("full"),
            Source::Hf {
                repo: "org/repo".into(),
                revision: "v1.0".into(),
                quantization: Some("Q4_K_M".into())
            }
        );
        for bad in [
            "hf://repo",
            "hf://a/b/c",
            "hf://a/..",
            "hf://a/b@",
            "hf://a/b:",
            "hf://a/b@../x",
            "ftp://x",
            "file://rel",
            "s3:///x",
        ] {
            assert!(
                Source::parse_on_node(bad).is_err(),
                "{bad} should be refused"
            );
        }
    }

    #[test]
    fn cache_dirs_stay_inside_the_cache() {
        let s = Source::parse_on_node("s3://bucket/a/../b").expect_err("dotdot");
        assert!(s.to_string().contains(".."), "{s}");
        let s = Source::parse_on_node("hf://org/repo@refs/pr/1").expect("pr ref");
        assert_eq!(cache_subdir(&s), PathBuf::from("hf/org--repo/refs--pr--1"));
        let s = Source::parse_on_node("https://h.example:8443/m/x.gguf").expect("url");
        assert_eq!(
            cache_subdir(&s),
            PathBuf::from("https/h.example-8443/m/x.gguf")
        );
        let s = Source::parse_on_node("s3://bkt/models/gemma/").expect("s3");
        assert_eq!(
            s,
            Source::S3 {
                bucket: "bkt".into(),
                prefix: "models/gemma".into()
            }
        );
        assert_eq!(cache_subdir(&s), PathBuf::from("s3/bkt/models/gemma"));
    }
}
