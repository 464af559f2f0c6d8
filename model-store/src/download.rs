//! Model store, step 4 (at node start, in the background): fetch one file into the cache, verified.
//!
//! A file is written to `{name}.partial`, resumed with an HTTP `Range`
//! request after a dropped connection, checked against its size (always)
//! and sha256 (when the source gives one), flushed, and only then renamed
//! into place — so a file under its final name is always complete. Transient
//! failures (connection errors, 5xx, 429, a body cut short) are retried with
//! exponential backoff; a 4xx, a checksum or a size mismatch are not.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use futures::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_LENGTH, CONTENT_RANGE, ETAG, RANGE};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::remote::{Remote, sha256_etag};
use super::{DownloadProgress, RemoteFile, StoreError};

/// Retry schedule: 100 ms, 200 ms, 400 ms between four attempts, each
/// delay capped at 2 s.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    pub initial: Duration,
    pub attempts: usize,
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            attempts: 4,
            cap: Duration::from_secs(2),
        }
    }
}

impl RetryPolicy {
    pub fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.initial)
            .with_max_delay(self.cap)
            .with_factor(2.0)
            .with_max_times(self.attempts.saturating_sub(1))
    }
}

fn partial_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    dest.with_file_name(name)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// sha256 of what is already on disk, so a resumed download is verified whole.
fn hash_prefix(path: &Path) -> Result<(Sha256, u64), StoreError> {
    let mut hasher = Sha256::new();
    let mut n = 0u64;
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((hasher, 0)),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let k = f.read(&mut buf).map_err(io_err(path))?;
        if k == 0 {
            return Ok((hasher, n));
        }
        hasher.update(&buf[..k]);
        n += k as u64;
    }
}

/// Download `file` to `dest` unless it is already there.
pub async fn fetch_file(
    client: &reqwest::Client,
    remote: &Remote,
    file: &RemoteFile,
    dest: &Path,
    progress: &DownloadProgress,
    retry: RetryPolicy,
) -> Result<(), StoreError> {
    if let Ok(md) = std::fs::metadata(dest)
        && md.is_file()
        && (file.size == 0 || md.len() == file.size)
    {
        progress.add_cached(md.len(), file.size == 0);
        return Ok(());
    }
    if let Some(parent) = dest.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(io_err(parent))?;
    }
    let partial = partial_path(dest);
    let attempt = || attempt(client, remote, file, dest, &partial, progress);
    attempt
        .retry(retry.backoff())
        .when(StoreError::is_transient)
        .notify(|e, after| {
            tracing::warn!(file = %file.path, error = %e, retry_in_ms = after.as_millis() as u64, "download attempt failed; retrying");
        })
        .await
}

async fn attempt(
    client: &reqwest::Client,
    remote: &Remote,
    file: &RemoteFile,
    dest: &Path,
    partial: &Path,
    progress: &DownloadProgress,
) -> Result<(), StoreError> {
    let mut offset = std::fs::metadata(partial).map_or(0, |m| m.len());
    if file.size > 0 && offset > file.size {
        progress.reset_current();
        std::fs::remove_file(partial).map_err(io_err(partial))?;
        offset = 0;
    }
    progress.start_file(offset);
    let mut expected_sha = file.sha256.clone();
    let mut expected_size = (file.size > 0).then_some(file.size);
    if expected_size != Some(offset) || offset == 0 {
        let mut req = remote.request(client, &file.path)?;
        if offset > 0 {
            req = req.header(RANGE, format!("bytes={offset}-"));
        }
        let resp = req.send().await.map_err(|e| StoreError::Transient {
            file: file.path.clone(),
            reason: format!("request failed: {e}"),
        })?;
        let status = resp.status();
        match status {
            StatusCode::PARTIAL_CONTENT => {}
            StatusCode::OK => {
                if offset > 0 {
                    // The server ignored the range: start over.
                    progress.reset_current();
                    offset = 0;
                }
            }
            StatusCode::RANGE_NOT_SATISFIABLE => {
                progress.reset_current();
                std::fs::remove_file(partial).map_err(io_err(partial))?;
                return Err(StoreError::Transient {
                    file: file.path.clone(),
                    reason: format!("range from byte {offset} refused; starting over"),
                });
            }
            s if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS => {
                return Err(StoreError::Transient {
                    file: file.path.clone(),
                    reason: format!("HTTP {s}"),
                });
            }
            s => {
                let hint = match s.as_u16() {
                    401 | 403 => " (a private or gated model needs a token)",
                    404 => " (not found)",
                    _ => "",
                };
                return Err(StoreError::Download {
                    file: file.path.clone(),
                    reason: format!("HTTP {s}{hint}"),
                });
            }
        }
        let headers = resp.headers();
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        if expected_sha.is_none() {
            expected_sha = header("x-linked-etag")
                .or_else(|| header(ETAG.as_str()))
                .and_then(sha256_etag);
        }
        if expected_size.is_none() {
            expected_size = header("x-linked-size")
                .and_then(|v| v.parse().ok())
                .or_else(|| {
                    header(CONTENT_RANGE.as_str())
                        .and_then(|v| v.rsplit('/').next())
                        .and_then(|v| v.parse().ok())
                })
                .or_else(|| {
                    (status == StatusCode::OK)
                        .then(|| header(CONTENT_LENGTH.as_str()).and_then(|v| v.parse().ok()))
                        .flatten()
                });
            if let Some(n) = expected_size {
                progress.learn_total(n);
            }
        }
        let (mut hasher, mut written) = if offset > 0 {
            hash_prefix(partial)?
        } else {
            (Sha256::new(), 0)
        };
        let mut out = tokio::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(offset > 0)
            .truncate(offset == 0)
            .open(partial)
            .await
            .map_err(io_err(partial))?;
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    out.flush().await.map_err(io_err(partial))?;
                    return Err(StoreError::Transient {
                        file: file.path.clone(),
                        reason: format!("connection lost after {written} bytes: {e}"),
                    });
                }
            };
            out.write_all(&chunk).await.map_err(io_err(partial))?;
            hasher.update(&chunk);
            written += chunk.len() as u64;
            progress.add_done(chunk.len() as u64);
            if expected_size.is_some_and(|n| written > n) {
                break;
            }
        }
        out.flush().await.map_err(io_err(partial))?;
        out.sync_all().await.map_err(io_err(partial))?;
        drop(out);
        return finish(
            file,
            dest,
            partial,
            expected_size,
            expected_sha,
            written,
            hasher,
            progress,
        );
    }
    // Everything is on disk already (a previous run stopped before the rename).
    let (hasher, written) = hash_prefix(partial)?;
    finish(
        file,
        dest,
        partial,
        expected_size,
        expected_sha,
        written,
        hasher,
        progress,
    )
}

#[allow(clippy::too_many_arguments)] // one call site; a struct would only rename these
fn finish(
    file: &RemoteFile,
    dest: &Path,
    partial: &Path,
    expected_size: Option<u64>,
    expected_sha: Option<String>,
    written: u64,
    hasher: Sha256,
    progress: &DownloadProgress,
) -> Result<(), StoreError> {
    if let Some(n) = expected_size {
        if written < n {
            return Err(StoreError::Transient {
                file: file.path.clone(),
                reason: format!("the body ended at {written} of {n} bytes"),
            });
        }
        if written > n {
            progress.reset_current();
            let _ = std::fs::remove_file(partial);
            return Err(StoreError::Size {
                file: file.path.clone(),
                expected: n,
                got: written,
            });
        }
    }
    if let Some(want) = expected_sha {
        let got = hex::encode(hasher.finalize());
        if got != want {
            progress.reset_current();
            let _ = std::fs::remove_file(partial);
            return Err(StoreError::Checksum {
                file: file.path.clone(),
                expected: want,
                got,
            });
        }
    }
    std::fs::rename(partial, dest).map_err(io_err(dest))?;
    progress.complete_current();
    tracing::info!(file = %file.path, bytes = written, "download complete and verified");
    Ok(())
}
