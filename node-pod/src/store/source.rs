//! Model store, step 1 (before any request, at node start): where a model's artifacts live.
//!
//! Parses the source URI the operator renders (`hf://org/repo[@revision][:QUANT]`,
//! `https://…`, `file:///…`, `s3://bucket/prefix`) and carries the
//! endpoints and credentials each kind needs, read from the standard
//! environment variables (`HF_ENDPOINT`, `HF_TOKEN`, `HF_TOKEN_PATH`,
//! `GANTRY_SOURCE_TOKEN`, `AWS_*`) or set explicitly.

use std::path::PathBuf;

use url::Url;

use super::StoreError;

/// Where a model's files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A Hugging Face repository at a revision (branch, tag or commit).
    Hf {
        repo: String,
        revision: String,
        /// The `:QUANT` suffix of `hf://org/repo:Q4_K_M`.
        quantization: Option<String>,
    },
    /// A direct URL: one file, or the base the model's `files` are relative to.
    Https { url: Url },
    /// A local file or directory (a mounted volume).
    File { path: PathBuf },
    /// Objects under a prefix of an S3-compatible bucket.
    S3 { bucket: String, prefix: String },
}

fn invalid(uri: &str, reason: impl Into<String>) -> StoreError {
    StoreError::Source {
        uri: uri.to_string(),
        reason: reason.into(),
    }
}

/// One path segment of a repo id: what the Hub accepts (letters, digits, `-`, `_`, `.`).
fn repo_segment_ok(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl Source {
    pub fn parse(uri: &str) -> Result<Self, StoreError> {
        if let Some(rest) = uri.strip_prefix("hf://") {
            // `org/repo[@revision][:QUANT]`; a repo id never holds `@` or `:`.
            let (rest, quantization) = match rest.rsplit_once(':') {
                Some((r, q)) if !q.is_empty() && !q.contains('/') => (r, Some(q.to_string())),
                Some(_) => return Err(invalid(uri, "an empty quantization after `:`")),
                None => (rest, None),
            };
            let (repo, revision) = match rest.split_once('@') {
                Some((r, rev)) if !rev.is_empty() => (r, rev.to_string()),
                Some(_) => return Err(invalid(uri, "an empty revision after `@`")),
                None => (rest, "main".to_string()),
            };
            let parts: Vec<&str> = repo.split('/').collect();
            if parts.len() != 2 || !parts.iter().all(|p| repo_segment_ok(p)) {
                return Err(invalid(
                    uri,
                    "expected hf://org/repo[@revision][:QUANT] with letters, digits, `-`, `_`, `.`",
                ));
            }
            if revision
                .split('/')
                .any(|s| s.is_empty() || s == "." || s == "..")
            {
                return Err(invalid(uri, format!("bad revision {revision:?}")));
            }
            return Ok(Source::Hf {
                repo: repo.to_string(),
                revision,
                quantization,
            });
        }
        if let Some(rest) = uri.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(invalid(uri, "expected s3://bucket/prefix"));
            }
            if prefix.split('/').any(|s| s == "..") {
                return Err(invalid(uri, "the prefix must not contain `..`"));
            }
            return Ok(Source::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.trim_matches('/').to_string(),
            });
        }
        if let Some(p) = uri.strip_prefix("file://") {
            if !p.starts_with('/') {
                return Err(invalid(
                    uri,
                    "a file:// source must be absolute (file:///path)",
                ));
            }
            return Ok(Source::File {
                path: PathBuf::from(p),
            });
        }
        if uri.starts_with("https://") || uri.starts_with("http://") {
            let url = Url::parse(uri).map_err(|e| invalid(uri, e.to_string()))?;
            return Ok(Source::Https { url });
        }
        Err(invalid(
            uri,
            "the scheme must be hf://, https://, file:// or s3://",
        ))
    }

    /// Whether the files must be fetched into the cache first.
    pub fn is_remote(&self) -> bool {
        !matches!(self, Source::File { .. })
    }

    /// The cache directory for this source, relative to the cache root.
    /// Each part is sanitized so that no source can name a path outside it.
    pub fn cache_subdir(&self) -> PathBuf {
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
        match self {
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
            Source::File { path } => path.clone(),
        }
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
            Source::parse("hf://google/gemma-3-270m").expect("plain"),
            Source::Hf {
                repo: "google/gemma-3-270m".into(),
                revision: "main".into(),
                quantization: None
            }
        );
        assert_eq!(
            Source::parse("hf://org/repo@v1.0:Q4_K_M").expect("full"),
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
            assert!(Source::parse(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn cache_dirs_stay_inside_the_cache() {
        let s = Source::parse("s3://bucket/a/../b").expect_err("dotdot");
        assert!(s.to_string().contains(".."), "{s}");
        let s = Source::parse("hf://org/repo@refs/pr/1").expect("pr ref");
        assert_eq!(s.cache_subdir(), PathBuf::from("hf/org--repo/refs--pr--1"));
        let s = Source::parse("https://h.example:8443/m/x.gguf").expect("url");
        assert_eq!(
            s.cache_subdir(),
            PathBuf::from("https/h.example-8443/m/x.gguf")
        );
        let s = Source::parse("s3://b/models/gemma/").expect("s3");
        assert_eq!(
            s,
            Source::S3 {
                bucket: "b".into(),
                prefix: "models/gemma".into()
            }
        );
        assert_eq!(s.cache_subdir(), PathBuf::from("s3/b/models/gemma"));
    }
}
