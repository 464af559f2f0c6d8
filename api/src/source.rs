//! The source-URI grammar (operator validate step and node model store, step 1): what a
//! Model's `spec.source.uri` and a node's `models[].source` may say, checked by one function.
//!
//! The operator runs [`Source::parse`] plus [`Source::check_cluster_policy`] when it validates a
//! Model, and the node runs [`Source::parse`] when it reads its config and before its model store
//! lists anything, so a URI the operator accepts is one the node can fetch (and the reverse).
//! The CRD's admission pattern (`SOURCE_URI_PATTERN` in `gantry-crd`) is a coarse first filter
//! of the same grammar; this function is the authority.
//!
//! ```text
//! hf://org/repo[@revision][:QUANT]   Hugging Face repository (letters, digits, `-`, `_`, `.`)
//! https://host/path                  a direct URL (http:// only outside a cluster, e.g. tests)
//! s3://bucket[/prefix]               an S3-compatible bucket (bucket: 3-63 lowercase DNS chars)
//! pvc://claim/path                   a PersistentVolumeClaim (the operator mounts it; the node
//!                                    sees file:///models/claim/path)
//! file:///path                       a local file or directory
//! ```
//! No form may name a `..` path segment.

use std::fmt;
use std::path::PathBuf;

use url::Url;

/// Where the operator mounts a `pvc://claim/...` source inside a node pod.
pub const PVC_MOUNT_DIR: &str = "/models";

/// A source URI that broke the grammar: the URI and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceError {
    pub uri: String,
    pub reason: String,
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "source {:?}: {}", self.uri, self.reason)
    }
}

impl std::error::Error for SourceError {}

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
    /// A path inside a PersistentVolumeClaim of the Model's namespace.
    Pvc { claim: String, path: String },
}

fn invalid(uri: &str, reason: impl Into<String>) -> SourceError {
    SourceError {
        uri: uri.to_string(),
        reason: reason.into(),
    }
}

/// One path segment of a repo id: what the Hub accepts (a letter or digit, then letters, digits,
/// `-`, `_`, `.`).
fn repo_segment_ok(s: &str) -> bool {
    s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A quantization name as a Model's `spec.source.quantization` may say it.
pub fn is_quantization(s: &str) -> bool {
    (1..=32).contains(&s.len())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// A Kubernetes DNS-1123 subdomain (claim and bucket names).
pub fn is_dns1123_subdomain(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 253
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Whether a `/`-separated path names a `..` segment.
pub fn has_parent_segment(path: &str) -> bool {
    path.split('/').any(|s| s == "..")
}

/// A `files` entry (relative to the source): relative, non-empty, without `..`.
pub fn check_relative_file(file: &str) -> Result<(), String> {
    if file.is_empty() || file.starts_with('/') || has_parent_segment(file) {
        Err(format!(
            "entries are relative paths without `..`, got {file:?}"
        ))
    } else {
        Ok(())
    }
}

impl Source {
    /// Parse a source URI by the grammar in this module's header.
    pub fn parse(uri: &str) -> Result<Self, SourceError> {
        if let Some(rest) = uri.strip_prefix("hf://") {
            return parse_hf(uri, rest);
        }
        if let Some(rest) = uri.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.len() < 3 || bucket.len() > 63 || !is_dns1123_subdomain(bucket) {
                return Err(invalid(
                    uri,
                    "expected s3://bucket/prefix with a bucket name of 3-63 lowercase letters, digits, `-`, `.`",
                ));
            }
            if has_parent_segment(prefix) {
                return Err(invalid(uri, "the prefix must not contain `..`"));
            }
            return Ok(Source::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.trim_matches('/').to_string(),
            });
        }
        if let Some(rest) = uri.strip_prefix("pvc://") {
            return match rest.split_once('/') {
                Some((claim, path)) if is_dns1123_subdomain(claim) && !path.is_empty() => {
                    if has_parent_segment(path) {
                        return Err(invalid(uri, "pvc:// paths must not contain `..`"));
                    }
                    Ok(Source::Pvc {
                        claim: claim.to_string(),
                        path: path.to_string(),
                    })
                }
                _ => Err(invalid(
                    uri,
                    "expected pvc://claim/path with a valid claim name",
                )),
            };
        }
        if let Some(p) = uri.strip_prefix("file://") {
            if !p.starts_with('/') || p.len() < 2 {
                return Err(invalid(
                    uri,
                    "a file:// source must be absolute (file:///path)",
                ));
            }
            if has_parent_segment(p) {
                return Err(invalid(uri, "file:// paths must not contain `..`"));
            }
            return Ok(Source::File {
                path: PathBuf::from(p),
            });
        }
        if let Some(rest) = uri
            .strip_prefix("https://")
            .or_else(|| uri.strip_prefix("http://"))
        {
            if rest.is_empty() || rest.starts_with('/') {
                return Err(invalid(uri, "a URL source needs a host"));
            }
            // Checked on the text as written: parsing the URL would resolve the `..` away.
            let path = rest.split(['?', '#']).next().unwrap_or_default();
            if has_parent_segment(path) {
                return Err(invalid(uri, "the path must not contain `..`"));
            }
            let url = Url::parse(uri).map_err(|e| invalid(uri, e.to_string()))?;
            return Ok(Source::Https { url });
        }
        Err(invalid(
            uri,
            "the scheme must be hf://, https://, s3://, pvc:// or file://",
        ))
    }

    /// The grammar as a node applies it (config validation and the model store): a `pvc://`
    /// claim reaches a node already mounted, as `file:///models/claim/path`, so a node config
    /// never names one.
    pub fn parse_on_node(uri: &str) -> Result<Self, SourceError> {
        match Source::parse(uri)? {
            Source::Pvc { .. } => Err(invalid(
                uri,
                "a pvc:// claim reaches the node mounted: name it as file:///models/claim/path",
            )),
            s => Ok(s),
        }
    }

    /// What a Model in a cluster may not use although the grammar allows it: plain `http://`
    /// (weights and tokens would cross the network unencrypted). The node accepts it for local
    /// runs and tests.
    pub fn check_cluster_policy(&self, uri: &str) -> Result<(), SourceError> {
        match self {
            Source::Https { url } if url.scheme() == "http" => Err(invalid(
                uri,
                "a Model's URL source must use https:// (plain http:// is for local runs only)",
            )),
            _ => Ok(()),
        }
    }

    /// The URI the node is given: a `pvc://claim/path` becomes the mounted
    /// `file:///models/claim/path`; every other source is passed as written.
    pub fn node_uri(&self, uri: &str) -> String {
        match self {
            Source::Pvc { claim, path } => format!("file://{PVC_MOUNT_DIR}/{claim}/{path}"),
            _ => uri.to_string(),
        }
    }

    /// Whether the files must be fetched into a cache first.
    pub fn is_remote(&self) -> bool {
        !matches!(self, Source::File { .. } | Source::Pvc { .. })
    }
}

/// `hf://org/repo[@revision][:QUANT]`; a repo id never holds `@` or `:`.
fn parse_hf(uri: &str, rest: &str) -> Result<Source, SourceError> {
    let (rest, quantization) = match rest.rsplit_once(':') {
        Some((r, q)) if is_quantization(q) => (r, Some(q.to_string())),
        Some((_, "")) => return Err(invalid(uri, "an empty quantization after `:`")),
        Some((_, q)) => {
            return Err(invalid(
                uri,
                format!("bad quantization {q:?} (letters, digits, `_`, `.`, `-`; at most 32)"),
            ));
        }
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
    let revision_chars_ok = revision
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/' | '-'));
    if !revision_chars_ok
        || revision
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err(invalid(uri, format!("bad revision {revision:?}")));
    }
    Ok(Source::Hf {
        repo: repo.to_string(),
        revision,
        quantization,
    })
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
    }

    #[test]
    fn pvc_sources_reach_the_node_as_the_mounted_path() {
        let uri = "pvc://store/qwen/q.gguf";
        let s = Source::parse(uri).expect("pvc");
        assert_eq!(s.node_uri(uri), "file:///models/store/qwen/q.gguf");
        assert!(!s.is_remote());
    }
}
