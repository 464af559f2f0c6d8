//! The node config file (at start, before the request path; afterwards beside it): read it
//! with the `serve` flags over it, then re-read it on a timer and on SIGHUP and hand each new
//! version to `Node::reload` (node/reload.rs).
//!
//! In a cluster the file is a ConfigMap mounted as a directory (`/etc/gantry/models.yaml`, not
//! through `subPath`), which kubelet replaces in place by swapping a `..data` symlink, so a
//! read sees the old file or the new one whole. The poll compares the hash of the bytes with
//! that of the last version it acted on: an unchanged file costs one read, and a refused one
//! is refused once, not at every tick.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gantry_api::config::{ConfigError, NodeConfig, config_hash};

use crate::node::{Node, ReloadError};

/// The `serve` flags that override the config file's node-wide settings; applied to every
/// version read, so a flag never shows up as a change that needs a restart.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub request_timeout: Option<u64>,
    pub threads: Option<u32>,
    pub prefill_chunk_tokens: Option<u32>,
    pub no_response_cache: bool,
    pub isolation: Option<gantry_api::config::Isolation>,
}

impl Overrides {
    pub fn apply(&self, config: &mut NodeConfig) {
        let s = &mut config.scheduler;
        if let Some(t) = self.request_timeout {
            s.request_timeout_seconds = t;
        }
        if let Some(t) = self.threads {
            s.threads = t;
        }
        if let Some(n) = self.prefill_chunk_tokens {
            s.prefill_chunk_tokens = n;
        }
        if self.no_response_cache {
            s.response_cache_ram_fraction = 0.0;
        }
        if let Some(i) = self.isolation {
            config.isolation.default = i;
        }
    }
}

/// The config file `gantry-node serve --config` runs from.
#[derive(Clone, Debug)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub overrides: Overrides,
}

/// One version of the file: what the node runs, and the hash of the bytes it came from.
#[derive(Clone, Debug)]
pub struct Version {
    pub config: NodeConfig,
    pub hash: String,
}

impl ConfigFile {
    /// Read the file now (at start).
    pub fn read(&self) -> Result<Version, ConfigError> {
        let bytes = self.bytes()?;
        Ok(Version {
            config: self.parse(&bytes)?,
            hash: config_hash(&bytes),
        })
    }

    fn bytes(&self) -> Result<Vec<u8>, ConfigError> {
        std::fs::read(&self.path).map_err(|source| ConfigError::Read {
            path: self.path.clone(),
            source,
        })
    }

    /// Parse and validate `bytes`, then apply the flags (and validate again: a flag may
    /// break a rule).
    fn parse(&self, bytes: &[u8]) -> Result<NodeConfig, ConfigError> {
        let mut config = NodeConfig::from_yaml(bytes, &self.path)?;
        self.overrides.apply(&mut config);
        config.validate()?;
        Ok(config)
    }
}

/// What a reload check acted on last: the hash of the bytes, or why the file was unreadable.
type Seen = Option<String>;

/// Reload `node` from `file` every `every` (`None`: only on SIGHUP) and on each SIGHUP. The
/// SIGHUP handler is installed before this returns (a SIGHUP would otherwise end the process);
/// call it on the runtime.
pub fn spawn_reloads(
    node: Arc<Node>,
    file: ConfigFile,
    every: Option<Duration>,
) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = signal(SignalKind::hangup())?;
    let mut tick = every.map(|d| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    tracing::info!(path = %file.path.display(), every_s = every.map_or(0, |d| d.as_secs()), "config reload: polling the file, and on SIGHUP");
    tokio::spawn(async move {
        let mut seen: Seen = node.config_hash();
        loop {
            let signalled = tokio::select! {
                s = hangup.recv() => match s {
                    Some(()) => true,
                    None => return, // the signal stream ended: the runtime is going down
                },
                () = next_tick(&mut tick) => false,
            };
            let bytes = tokio::fs::read(&file.path)
                .await
                .map_err(|source| ConfigError::Read {
                    path: file.path.clone(),
                    source,
                });
            check(&node, &file, bytes, &mut seen, signalled);
        }
    });
    Ok(())
}

async fn next_tick(tick: &mut Option<tokio::time::Interval>) {
    match tick {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Act on one read of the file: nothing when it is the version in force, or (on the timer)
/// the version acted on last; else reload, or refuse.
fn check(
    node: &Arc<Node>,
    file: &ConfigFile,
    bytes: Result<Vec<u8>, ConfigError>,
    seen: &mut Seen,
    signalled: bool,
) {
    let key = match &bytes {
        Ok(b) => config_hash(b),
        Err(e) => format!("unreadable: {e}"),
    };
    if !signalled && seen.as_deref() == Some(key.as_str()) {
        return;
    }
    *seen = Some(key.clone());
    if node.config_hash().as_deref() == Some(key.as_str()) {
        if signalled {
            tracing::info!(hash = %key, "SIGHUP: the config file is the one in force; nothing to reload");
        }
        return;
    }
    let parsed = bytes.and_then(|b| file.parse(&b));
    match parsed {
        Ok(config) => {
            // `reload` logs and counts its own refusal.
            let _ = node.reload(config, Some(key));
        }
        Err(e) => node.refuse_reload(&ReloadError::from(e)),
    }
}
