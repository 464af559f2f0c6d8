//! Model store, step 2 (at node start): list a remote source's files and build each file's download request.
//!
//! Hugging Face: the tree API (`/api/models/{repo}/tree/{revision}?recursive=true`,
//! paginated by `Link: rel="next"`, as `huggingface_hub.list_repo_tree` does)
//! gives each file's size and, for LFS files, its sha256 (`lfs.oid`); files
//! come from `/{repo}/resolve/{revision}/{path}`. S3: `ListObjectsV2` and
//! presigned `GetObject` URLs (signed with `rusty-s3`, sent with `reqwest`).
//! A direct `https://` URL is one file whose size and sha256 come from the
//! response headers when the server gives them.

use std::time::Duration;

use reqwest::header::{HeaderMap, LINK};
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
use serde::Deserialize;
use url::Url;

use super::source::{Source, SourceSettings};
use super::{RemoteFile, StoreError};

/// Most listing pages read from one source (1,000 entries each on the Hub and S3).
const MAX_LIST_PAGES: usize = 100;
/// How long a presigned S3 URL stays valid; a new one is signed per attempt.
const PRESIGN_SECONDS: u64 = 3600;

/// A listed source, ready to hand out download requests.
pub struct Remote {
    source: Source,
    settings: SourceSettings,
    bucket: Option<Bucket>,
    credentials: Option<Credentials>,
}

#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    lfs: Option<TreeLfs>,
}

#[derive(Deserialize)]
struct TreeLfs {
    oid: String,
    size: u64,
}

/// The parts of a `ListObjectsV2` response the store reads. Parsed here
/// rather than with `rusty_s3::actions::ListObjectsV2::parse_response`,
/// which refuses entries without an `ETag` (some S3-compatible servers omit it).
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ListBucketResult {
    #[serde(default)]
    contents: Vec<ListedObject>,
    #[serde(default)]
    next_continuation_token: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ListedObject {
    key: String,
    size: u64,
    #[serde(default, rename = "ETag")]
    etag: Option<String>,
}

/// A 64-hex-digit sha256 from an `ETag`/`X-Linked-Etag` value, if it is one
/// (`"…"` and `W/` stripped). An S3 MD5 ETag is not one.
pub fn sha256_etag(value: &str) -> Option<String> {
    let v = value.trim().trim_start_matches("W/").trim_matches('"');
    (v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit())).then(|| v.to_ascii_lowercase())
}

/// The URL of the next page from a `Link` header (`<url>; rel="next"`).
fn next_link(headers: &HeaderMap) -> Option<String> {
    let link = headers.get(LINK)?.to_str().ok()?;
    link.split(',').find_map(|part| {
        let (url, params) = part.split_once(';')?;
        params
            .split(';')
            .any(|p| p.trim().replace(' ', "") == "rel=\"next\"")
            .then(|| {
                url.trim()
                    .trim_start_matches('<')
                    .trim_end_matches('>')
                    .to_string()
            })
    })
}

/// A relative path from a listing, refused when it could leave the cache directory.
fn safe_relative(path: &str) -> Result<String, StoreError> {
    let p = path.trim_start_matches('/');
    if p.is_empty()
        || p.split('/')
            .any(|s| s.is_empty() || s == "." || s == ".." || s.contains('\\'))
    {
        return Err(StoreError::Listing(format!(
            "the source lists a path that would leave the cache directory: {path:?}"
        )));
    }
    Ok(p.to_string())
}

impl Remote {
    pub fn new(source: Source, settings: SourceSettings) -> Result<Self, StoreError> {
        let (mut bucket, mut credentials) = (None, None);
        if let Source::S3 { bucket: name, .. } = &source {
            let endpoint = settings
                .s3_endpoint
                .clone()
                .unwrap_or_else(|| "https://s3.amazonaws.com".to_string());
            let url = Url::parse(&endpoint).map_err(|e| StoreError::Source {
                uri: endpoint.clone(),
                reason: format!("bad S3 endpoint: {e}"),
            })?;
            // A custom endpoint (MinIO, Ceph, R2, …) is addressed path-style;
            // AWS itself virtual-host style.
            let style = if settings.s3_endpoint.is_some() {
                UrlStyle::Path
            } else {
                UrlStyle::VirtualHost
            };
            let region = settings
                .s3_region
                .clone()
                .unwrap_or_else(|| "us-east-1".to_string());
            bucket = Some(Bucket::new(url, style, name.clone(), region).map_err(|e| {
                StoreError::Source {
                    uri: format!("s3://{name}"),
                    reason: format!("bad S3 bucket or endpoint: {e}"),
                }
            })?);
            credentials = match (&settings.aws_access_key_id, &settings.aws_secret_access_key) {
                (Some(k), Some(s)) => Some(match &settings.aws_session_token {
                    Some(t) => Credentials::new_with_token(k, s, t),
                    None => Credentials::new(k, s),
                }),
                _ => None,
            };
        }
        Ok(Self {
            source,
            settings,
            bucket,
            credentials,
        })
    }

    /// `{endpoint}/{before…}/{org}/{repo}/{after…}/{path…}`, each segment
    /// percent-encoded on its own (a revision `refs/pr/1` becomes `refs%2Fpr%2F1`,
    /// as `huggingface_hub` quotes it).
    fn hf_url(
        &self,
        before: &[&str],
        repo: &str,
        after: &[&str],
        path: &str,
    ) -> Result<Url, StoreError> {
        let endpoint = self.settings.hf_endpoint();
        let mut url = Url::parse(endpoint).map_err(|e| StoreError::Source {
            uri: endpoint.to_string(),
            reason: format!("bad HF_ENDPOINT: {e}"),
        })?;
        {
            let mut segs = url.path_segments_mut().map_err(|()| StoreError::Source {
                uri: endpoint.to_string(),
                reason: "HF_ENDPOINT cannot be a base URL".into(),
            })?;
            segs.pop_if_empty()
                .extend(before)
                .extend(repo.split('/'))
                .extend(after)
                .extend(path.split('/').filter(|s| !s.is_empty()));
        }
        Ok(url)
    }

    fn authorized(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match (&self.source, &self.settings.token) {
            (Source::Hf { .. } | Source::Https { .. }, Some(t)) => req.bearer_auth(t),
            _ => req,
        }
    }

    /// Every file of the source with its size and, where known, sha256.
    pub async fn list(&self, client: &reqwest::Client) -> Result<Vec<RemoteFile>, StoreError> {
        match &self.source {
            Source::Hf { repo, revision, .. } => self.list_hf(client, repo, revision).await,
            Source::S3 { prefix, .. } => self.list_s3(client, prefix).await,
            Source::Https { url } => Ok(vec![RemoteFile {
                path: url
                    .path_segments()
                    .and_then(|mut s| s.next_back())
                    .filter(|n| !n.is_empty())
                    .map(str::to_string)
                    .ok_or_else(|| StoreError::Listing(format!("{url} names no file")))?,
                size: 0,
                sha256: None,
            }]),
            Source::File { .. } | Source::Pvc { .. } => Err(StoreError::Listing(
                "a local source is listed from disk, not over the network".into(),
            )),
        }
    }

    async fn list_hf(
        &self,
        client: &reqwest::Client,
        repo: &str,
        revision: &str,
    ) -> Result<Vec<RemoteFile>, StoreError> {
        let mut first = self.hf_url(&["api", "models"], repo, &["tree", revision], "")?;
        first.set_query(Some("recursive=true"));
        let mut next = Some(first.to_string());
        let mut files = Vec::new();
        for _ in 0..MAX_LIST_PAGES {
            let Some(url) = next.take() else {
                return Ok(files);
            };
            let resp = self
                .authorized(client.get(&url))
                .send()
                .await
                .map_err(|e| StoreError::Transient {
                    file: format!("hf://{repo}"),
                    reason: format!("listing: GET {url}: {e}"),
                })?;
            let status = resp.status();
            if status.is_server_error() || status.as_u16() == 429 {
                return Err(StoreError::Transient {
                    file: format!("hf://{repo}"),
                    reason: format!("listing: HTTP {status}"),
                });
            }
            if !status.is_success() {
                let hint = match status.as_u16() {
                    401 | 403 => {
                        " (a gated or private repo needs a token: HF_TOKEN or the Model's secretRef)"
                    }
                    404 => " (no such repo or revision)",
                    _ => "",
                };
                return Err(StoreError::Listing(format!(
                    "listing hf://{repo}@{revision}: HTTP {status}{hint}"
                )));
            }
            next = next_link(resp.headers());
            let entries: Vec<TreeEntry> = resp
                .json()
                .await
                .map_err(|e| StoreError::Listing(format!("listing hf://{repo}: {e}")))?;
            for e in entries.into_iter().filter(|e| e.kind == "file") {
                let (size, sha256) = match e.lfs {
                    Some(l) => (l.size, Some(l.oid.to_ascii_lowercase())),
                    None => (e.size, None),
                };
                files.push(RemoteFile {
                    path: safe_relative(&e.path)?,
                    size,
                    sha256,
                });
            }
        }
        Err(StoreError::Listing(format!(
            "hf://{repo} lists more than {MAX_LIST_PAGES} pages"
        )))
    }

    async fn list_s3(
        &self,
        client: &reqwest::Client,
        prefix: &str,
    ) -> Result<Vec<RemoteFile>, StoreError> {
        let bucket = self
            .bucket
            .as_ref()
            .ok_or_else(|| StoreError::Listing("no bucket".into()))?;
        let key_prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        let mut token: Option<String> = None;
        let mut files = Vec::new();
        for _ in 0..MAX_LIST_PAGES {
            let mut action = bucket.list_objects_v2(self.credentials.as_ref());
            if !key_prefix.is_empty() {
                action.with_prefix(key_prefix.as_str());
            }
            if let Some(t) = &token {
                action.with_continuation_token(t.as_str());
            }
            let url = action.sign(Duration::from_secs(PRESIGN_SECONDS));
            let resp = client
                .get(url)
                .send()
                .await
                .map_err(|e| StoreError::Transient {
                    file: format!("s3://{}/{key_prefix}", bucket.name()),
                    reason: format!("ListObjectsV2: {e}"),
                })?;
            let status = resp.status();
            if status.is_server_error() || status.as_u16() == 429 {
                return Err(StoreError::Transient {
                    file: format!("s3://{}/{key_prefix}", bucket.name()),
                    reason: format!("ListObjectsV2: HTTP {status}"),
                });
            }
            let body = resp
                .text()
                .await
                .map_err(|e| StoreError::Listing(format!("ListObjectsV2: {e}")))?;
            if !status.is_success() {
                return Err(StoreError::Listing(format!(
                    "ListObjectsV2 s3://{}/{key_prefix}: HTTP {status}: {}",
                    bucket.name(),
                    body.chars().take(300).collect::<String>()
                )));
            }
            let page: ListBucketResult = quick_xml::de::from_str(&body)
                .map_err(|e| StoreError::Listing(format!("ListObjectsV2 response: {e}")))?;
            for obj in page.contents {
                let Some(rel) = obj.key.strip_prefix(&key_prefix) else {
                    continue;
                };
                if rel.is_empty() || rel.ends_with('/') {
                    continue; // directory markers
                }
                files.push(RemoteFile {
                    path: safe_relative(rel)?,
                    size: obj.size,
                    sha256: obj.etag.as_deref().and_then(sha256_etag),
                });
            }
            match page.next_continuation_token {
                Some(t) => token = Some(t),
                None => return Ok(files),
            }
        }
        Err(StoreError::Listing(format!(
            "s3://{}/{key_prefix} lists more than {MAX_LIST_PAGES} pages",
            bucket.name()
        )))
    }

    /// The GET request for one listed file (without `Range`).
    pub fn request(
        &self,
        client: &reqwest::Client,
        path: &str,
    ) -> Result<reqwest::RequestBuilder, StoreError> {
        let url = match &self.source {
            Source::Hf { repo, revision, .. } => self
                .hf_url(&[], repo, &["resolve", revision], path)?
                .to_string(),
            Source::Https { url } => url.to_string(),
            Source::S3 { prefix, .. } => {
                let bucket = self
                    .bucket
                    .as_ref()
                    .ok_or_else(|| StoreError::Listing("no bucket".into()))?;
                let key = if prefix.is_empty() {
                    path.to_string()
                } else {
                    format!("{prefix}/{path}")
                };
                bucket
                    .get_object(self.credentials.as_ref(), &key)
                    .sign(Duration::from_secs(PRESIGN_SECONDS))
                    .to_string()
            }
            Source::File { .. } | Source::Pvc { .. } => {
                return Err(StoreError::Listing(
                    "a local source is not downloaded".into(),
                ));
            }
        };
        Ok(self.authorized(client.get(url)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_objects_v2_pages_parse_with_or_without_etags() {
        let xml = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix>m/</Prefix><KeyCount>2</KeyCount><IsTruncated>true</IsTruncated>
<Contents><Key>m/a.gguf</Key><Size>12</Size><ETag>"9b2cf535f27731c974343645a3985328"</ETag></Contents>
<Contents><Key>m/b.gguf</Key><LastModified>2024-01-01T00:00:00Z</LastModified><Size>7</Size></Contents>
<NextContinuationToken>tok</NextContinuationToken></ListBucketResult>"#;
        let page: ListBucketResult = quick_xml::de::from_str(xml).expect("parse");
        assert_eq!(page.contents.len(), 2);
        assert_eq!(
            (page.contents[1].key.as_str(), page.contents[1].size),
            ("m/b.gguf", 7)
        );
        assert!(page.contents[1].etag.is_none());
        assert_eq!(page.next_continuation_token.as_deref(), Some("tok"));
    }

    #[test]
    fn etags_are_sha256_only_when_they_look_like_one() {
        let sha = "a".repeat(64);
        assert_eq!(sha256_etag(&format!("\"{sha}\"")), Some(sha.clone()));
        assert_eq!(
            sha256_etag(&format!("W/\"{}\"", sha.to_uppercase())),
            Some(sha)
        );
        assert_eq!(sha256_etag("\"9b2cf535f27731c974343645a3985328\""), None);
    }

    #[test]
    fn next_page_links_and_paths_leaving_the_cache() {
        let mut h = HeaderMap::new();
        h.insert(
            LINK,
            "<https://h/api/models/a/b/tree/main?cursor=x>; rel=\"next\""
                .parse()
                .expect("header"),
        );
        assert_eq!(
            next_link(&h).as_deref(),
            Some("https://h/api/models/a/b/tree/main?cursor=x")
        );
        for bad in ["../x", "a/../../b", "", "a//b", "a\\..\\b"] {
            assert!(safe_relative(bad).is_err(), "{bad:?}");
        }
        assert_eq!(safe_relative("/sub/x.gguf").expect("ok"), "sub/x.gguf");
    }
}
