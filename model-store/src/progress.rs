//! Download progress (model store → `/v1/status` and the 503 of a model still downloading):
//! bytes done and total, the rate, the state and its message, shared between the download and
//! the status endpoint.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use gantry_api::{ArtifactState, ArtifactStatus};

/// Download progress of one model, shared with the status endpoint.
#[derive(Debug)]
pub struct DownloadProgress {
    state: Mutex<(ArtifactState, Option<String>)>,
    /// Bytes of files complete on disk.
    completed: AtomicU64,
    /// Bytes of the file being downloaded that are on disk.
    current: AtomicU64,
    total: AtomicU64,
    /// Bytes received over the network by this process, for the rate.
    fetched: AtomicU64,
    started: Mutex<Option<Instant>>,
}

impl Default for DownloadProgress {
    fn default() -> Self {
        Self {
            state: Mutex::new((ArtifactState::Pending, None)),
            completed: AtomicU64::new(0),
            current: AtomicU64::new(0),
            total: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            started: Mutex::new(None),
        }
    }
}

impl DownloadProgress {
    pub fn set(&self, state: ArtifactState, message: Option<String>) {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        *g = (state, message);
    }

    pub fn state(&self) -> ArtifactState {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    pub(crate) fn begin(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        self.completed.store(0, Ordering::Relaxed);
        self.current.store(0, Ordering::Relaxed);
        self.fetched.store(0, Ordering::Relaxed);
        *self.started.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    pub(crate) fn add_cached(&self, bytes: u64, size_was_unknown: bool) {
        self.completed.fetch_add(bytes, Ordering::Relaxed);
        if size_was_unknown {
            self.total.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    pub(crate) fn start_file(&self, on_disk: u64) {
        self.current.store(on_disk, Ordering::Relaxed);
    }

    pub(crate) fn add_done(&self, bytes: u64) {
        self.current.fetch_add(bytes, Ordering::Relaxed);
        self.fetched.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn reset_current(&self) {
        self.current.store(0, Ordering::Relaxed);
    }

    pub(crate) fn complete_current(&self) {
        let n = self.current.swap(0, Ordering::Relaxed);
        self.completed.fetch_add(n, Ordering::Relaxed);
    }

    /// A size learned from response headers (a direct URL, the one file of
    /// its fetch); idempotent across retries.
    pub(crate) fn learn_total(&self, bytes: u64) {
        let floor = self.completed.load(Ordering::Relaxed) + bytes;
        self.total.fetch_max(floor, Ordering::Relaxed);
    }

    pub fn bytes_done(&self) -> u64 {
        self.completed.load(Ordering::Relaxed) + self.current.load(Ordering::Relaxed)
    }

    pub fn bytes_total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Network bytes per second since this process started the download.
    pub fn rate(&self) -> f64 {
        let started = *self.started.lock().unwrap_or_else(|p| p.into_inner());
        match started {
            Some(t) if self.state() == ArtifactState::Downloading => {
                let secs = t.elapsed().as_secs_f64();
                if secs > 0.0 {
                    self.fetched.load(Ordering::Relaxed) as f64 / secs
                } else {
                    0.0
                }
            }
            _ => 0.0,
        }
    }

    pub fn snapshot(&self) -> ArtifactStatus {
        let (state, message) = self.state.lock().unwrap_or_else(|p| p.into_inner()).clone();
        ArtifactStatus {
            state,
            bytes_done: self.bytes_done(),
            bytes_total: self.bytes_total(),
            bytes_per_second: self.rate(),
            message,
        }
    }
}
