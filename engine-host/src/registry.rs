//! Engine host, the plugin registry (node start-up and plugin updates; the node's engine
//! choice asks it): every discovered plugin directory and what became of it, the check that a
//! directory changed on disk, and the resolution of which plugin serves a model.

use std::path::{Path, PathBuf};

use gantry_api::config::{Isolation, IsolationConfig};
use gantry_api::selection::{Candidate, Selection, Wanted, passing, select};
use gantry_api::{EngineVerdict, RejectionKind};
use gantry_engine_abi::{Backend, EngineConfig, Format};
use serde::Serialize;

use crate::{ManifestError, Plugin, PluginManifest, WorkerSettings};

/// One discovered plugin directory and what became of it.
#[derive(Clone, Debug)]
pub struct PluginRecord {
    pub manifest_path: PathBuf,
    /// `None` when the manifest itself could not be parsed.
    pub manifest: Option<PluginManifest>,
    pub state: PluginState,
    /// Where its code runs (or would have run, when refused).
    pub isolation: Isolation,
    /// The directory's contents when it was read ([`fingerprint`]): a change is a new
    /// version of the plugin.
    pub fingerprint: String,
}

#[derive(Clone, Debug)]
pub enum PluginState {
    Loaded(Plugin),
    Refused { label: &'static str, reason: String },
}

impl PluginRecord {
    /// The id to show: the manifest's, or the directory's when unreadable.
    pub fn id(&self) -> String {
        match &self.manifest {
            Some(m) => m.id.clone(),
            None => self
                .manifest_path
                .parent()
                .and_then(Path::parent)
                .and_then(Path::file_name)
                .map_or_else(
                    || self.manifest_path.display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                ),
        }
    }

    pub fn plugin(&self) -> Option<&Plugin> {
        match &self.state {
            PluginState::Loaded(p) => Some(p),
            PluginState::Refused { .. } => None,
        }
    }

    /// A JSON-friendly summary for `engines list --json` and the status endpoint.
    pub fn summary(&self) -> PluginSummary {
        let m = self.manifest.as_ref();
        let (status, reason) = match &self.state {
            PluginState::Loaded(_) => ("loaded", None),
            PluginState::Refused { reason, .. } => ("refused", Some(reason.clone())),
        };
        PluginSummary {
            id: self.id(),
            version: m.map(|m| m.version.clone()),
            abi_version: m.map(|m| m.abi_version.clone()),
            gpu_backend: m.map(|m| m.gpu_backend.clone()),
            formats: m.map(|m| m.formats.clone()).unwrap_or_default(),
            architectures: m.map(|m| m.architectures.clone()).unwrap_or_default(),
            modalities: m.map(|m| m.modalities.clone()).unwrap_or_default(),
            license: m.and_then(|m| m.license.clone()),
            manifest: self.manifest_path.display().to_string(),
            build_info: self.plugin().and_then(|p| p.info().build_info.clone()),
            isolation: self
                .plugin()
                .map_or(self.isolation, Plugin::isolation)
                .as_str(),
            status,
            reason,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginSummary {
    pub id: String,
    pub version: Option<String>,
    pub abi_version: Option<String>,
    pub gpu_backend: Option<String>,
    pub formats: Vec<String>,
    pub architectures: Vec<String>,
    pub modalities: Vec<String>,
    pub license: Option<String>,
    pub manifest: String,
    /// How the loaded library uses the hardware (its CPU variant, for example); ABI 1.3.
    pub build_info: Option<String>,
    /// `inProcess`, or `process` (a worker process per loaded model).
    pub isolation: &'static str,
    pub status: &'static str,
    pub reason: Option<String>,
}

/// Every plugin this node found, loaded or refused, and the resolution rules.
#[derive(Debug)]
pub struct EngineRegistry {
    pub plugins_dir: PathBuf,
    pub backend: Backend,
    pub records: Vec<PluginRecord>,
}

/// How a registry runs its plugins: which isolation each gets and how workers start.
#[derive(Clone, Debug, Default)]
pub struct HostSettings {
    pub isolation: IsolationConfig,
    pub workers: WorkerSettings,
}

/// `<plugins>/*/*/manifest.json`, sorted by path.
fn manifest_paths(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let sorted = |d: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(d)
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    for engine_dir in sorted(dir) {
        for backend_dir in sorted(&engine_dir) {
            let m = backend_dir.join("manifest.json");
            if m.is_file() {
                out.push(m);
            }
        }
    }
    out
}

/// Marks a plugin directory whose copy is in progress: the plugin image's `/copy` helper
/// (copier/src/main.rs) creates it before the first file of a delivery and removes it after the
/// last. A marked directory is left alone (an old version keeps serving, a new directory is not
/// discovered yet), so a new library is never checked against the old manifest.
pub const COPY_IN_PROGRESS: &str = ".gantry-copy-in-progress";

/// Whether the plugin directory of `manifest_path` is being copied ([`COPY_IN_PROGRESS`]).
fn copy_in_progress(manifest_path: &Path) -> bool {
    manifest_path
        .parent()
        .is_some_and(|d| d.join(COPY_IN_PROGRESS).exists())
}

/// What a plugin directory holds now: its manifest's bytes, and each file's name, size,
/// modification time and inode (following links). A new library — a new image mounted by the
/// operator, or a file replaced by hand — changes it; hashing the libraries themselves on
/// every check would read tens of megabytes for nothing.
pub fn fingerprint(manifest_path: &Path) -> String {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::MetadataExt;
    let mut h = Sha256::new();
    h.update(std::fs::read(manifest_path).unwrap_or_default());
    let dir = manifest_path.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    for f in files {
        if let Ok(md) = std::fs::metadata(&f) {
            h.update(f.to_string_lossy().as_bytes());
            h.update(md.len().to_le_bytes());
            h.update(md.mtime().to_le_bytes());
            h.update(md.mtime_nsec().to_le_bytes());
            h.update(md.ino().to_le_bytes());
        }
    }
    hex::encode(h.finalize())
}

/// A plugin whose library changed on disk since the registry read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginChange {
    pub id: String,
    /// The new manifest's version, when it parses.
    pub version: Option<String>,
    pub kind: ChangeKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    /// A new version passed every check (in a probe worker) and is in the new registry; its
    /// models still run the old one until they are shadow-loaded.
    Loaded,
    /// The new version was refused; the new registry keeps the old one.
    Refused(String),
    /// An in-process plugin changed: a running node cannot replace mapped code.
    RestartRequired,
    /// A plugin directory that was not there before.
    Added,
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(hex::encode(h.finalize()))
}

impl EngineRegistry {
    /// Scan `plugins_dir`, validate every manifest and load what passes, every plugin in
    /// this process.
    pub fn discover(plugins_dir: &Path, config: &EngineConfig) -> EngineRegistry {
        Self::discover_with(plugins_dir, config, &HostSettings::default())
    }

    /// [`EngineRegistry::discover`], each plugin in the isolation `host` gives it.
    pub fn discover_with(
        plugins_dir: &Path,
        config: &EngineConfig,
        host: &HostSettings,
    ) -> EngineRegistry {
        let mut records: Vec<PluginRecord> = Vec::new();
        for manifest_path in manifest_paths(plugins_dir) {
            let record = Self::load_one(&manifest_path, config, &records, host);
            match &record.state {
                PluginState::Loaded(p) => tracing::info!(
                    plugin = %record.id(),
                    version = %p.info().engine_version,
                    isolation = p.isolation().as_str(),
                    manifest = %manifest_path.display(),
                    "engine plugin loaded"
                ),
                PluginState::Refused { label, reason } => tracing::error!(
                    target: "gantry::alert",
                    plugin = %record.id(),
                    manifest = %manifest_path.display(),
                    reason = %label,
                    "engine plugin refused: {reason}"
                ),
            }
            records.push(record);
        }
        if records.is_empty() {
            tracing::warn!(dir = %plugins_dir.display(), "no engine plugins found");
        }
        EngineRegistry {
            plugins_dir: plugins_dir.to_path_buf(),
            backend: config.backend,
            records,
        }
    }

    fn load_one(
        manifest_path: &Path,
        config: &EngineConfig,
        earlier: &[PluginRecord],
        host: &HostSettings,
    ) -> PluginRecord {
        let isolation = |m: &Option<PluginManifest>| {
            m.as_ref()
                .map_or(host.isolation.default, |m| host.isolation.for_plugin(&m.id))
        };
        let print = fingerprint(manifest_path);
        let refuse =
            |manifest: Option<PluginManifest>, label: &'static str, reason: String| PluginRecord {
                manifest_path: manifest_path.to_path_buf(),
                isolation: isolation(&manifest),
                manifest,
                state: PluginState::Refused { label, reason },
                fingerprint: print.clone(),
            };
        let manifest = match PluginManifest::read(manifest_path) {
            Ok(m) => m,
            Err(e) => return refuse(None, e.metric_label(), e.to_string()),
        };
        let loaded: Vec<String> = earlier
            .iter()
            .filter(|r| r.plugin().is_some())
            .filter_map(|r| r.manifest.as_ref().map(|m| m.id.clone()))
            .collect();
        let dir = manifest_path.parent().unwrap_or(Path::new("."));
        let binary = match manifest.validate(dir, config.backend, &loaded) {
            Ok(b) => b,
            Err(e) => return refuse(Some(manifest), e.metric_label(), e.to_string()),
        };
        if let Some(want) = &manifest.sha256 {
            match sha256_file(&binary) {
                Ok(got) if &got == want => {}
                Ok(got) => {
                    let e = ManifestError::Sha256Mismatch {
                        path: binary,
                        expected: want.clone(),
                        got,
                    };
                    return refuse(Some(manifest), e.metric_label(), e.to_string());
                }
                Err(e) => {
                    return refuse(
                        Some(manifest),
                        "binary_unreadable",
                        format!("cannot hash {}: {e}", binary.display()),
                    );
                }
            }
        }
        let opened = match host.isolation.for_plugin(&manifest.id) {
            Isolation::InProcess => Plugin::open(&binary, &manifest.id, config),
            Isolation::Process => {
                Plugin::open_isolated(&binary, &manifest.id, config, &host.workers)
            }
        };
        match opened {
            Ok(p) => PluginRecord {
                manifest_path: manifest_path.to_path_buf(),
                isolation: p.isolation(),
                manifest: Some(manifest),
                state: PluginState::Loaded(p),
                fingerprint: print.clone(),
            },
            Err(e) => refuse(Some(manifest), e.metric_label(), e.to_string()),
        }
    }

    /// Whether any plugin directory differs from what this registry read. A directory being
    /// copied counts as it was until its copy is complete.
    pub fn changed_on_disk(&self) -> bool {
        let now = manifest_paths(&self.plugins_dir);
        let removed = self.records.iter().any(|r| !now.contains(&r.manifest_path));
        removed
            || now.iter().any(|p| {
                !copy_in_progress(p)
                    && self
                        .records
                        .iter()
                        .find(|r| &r.manifest_path == p)
                        .is_none_or(|r| r.fingerprint != fingerprint(p))
            })
    }

    /// A registry for the plugin tree as it is now. An unchanged plugin keeps its loaded
    /// plugin. A changed plugin in `process` isolation is checked again in a probe worker: a
    /// version that passes replaces it, one that fails leaves the old one in place. A changed
    /// in-process plugin keeps its loaded library (mapped code cannot be replaced in a
    /// running process). A new directory is loaded; a removed one is dropped.
    pub fn refresh(
        &self,
        config: &EngineConfig,
        host: &HostSettings,
    ) -> (EngineRegistry, Vec<PluginChange>) {
        let mut records: Vec<PluginRecord> = Vec::new();
        let mut changes = Vec::new();
        for path in manifest_paths(&self.plugins_dir) {
            let old = self.records.iter().find(|r| r.manifest_path == path);
            if copy_in_progress(&path) {
                // Looked at once the copy is complete; the version read before serves meanwhile.
                records.extend(old.cloned());
                continue;
            }
            let print = fingerprint(&path);
            let Some(old) = old else {
                let rec = Self::load_one(&path, config, &records, host);
                changes.push(PluginChange {
                    id: rec.id(),
                    version: rec.manifest.as_ref().map(|m| m.version.clone()),
                    kind: ChangeKind::Added,
                });
                records.push(rec);
                continue;
            };
            if old.fingerprint == print {
                records.push(old.clone());
                continue;
            }
            let version = PluginManifest::read(&path).ok().map(|m| m.version);
            if old.plugin().is_some() && old.isolation == Isolation::InProcess {
                changes.push(PluginChange {
                    id: old.id(),
                    version,
                    kind: ChangeKind::RestartRequired,
                });
                // Seen: the change is reported once, not on every check.
                records.push(PluginRecord {
                    fingerprint: print,
                    ..old.clone()
                });
                continue;
            }
            // Checked against the plugins before it, as at discovery (ids must not clash).
            let earlier: Vec<PluginRecord> = records.clone();
            let rec = Self::load_one(&path, config, &earlier, host);
            match &rec.state {
                PluginState::Loaded(_) => {
                    changes.push(PluginChange {
                        id: rec.id(),
                        version,
                        kind: ChangeKind::Loaded,
                    });
                    records.push(rec);
                }
                PluginState::Refused { reason, .. } => {
                    changes.push(PluginChange {
                        id: old.id(),
                        version,
                        kind: ChangeKind::Refused(reason.clone()),
                    });
                    if old.plugin().is_some() {
                        records.push(PluginRecord {
                            fingerprint: print,
                            ..old.clone()
                        });
                    } else {
                        records.push(rec);
                    }
                }
            }
        }
        let reg = EngineRegistry {
            plugins_dir: self.plugins_dir.clone(),
            backend: self.backend,
            records,
        };
        (reg, changes)
    }

    /// Put `old`'s record for plugin `id` back in place of this registry's (an update whose
    /// models failed their shadow load).
    pub fn keep_old(&mut self, id: &str, old: &EngineRegistry) {
        if let (Some(i), Some(o)) = (
            self.records.iter().position(|r| r.id() == id),
            old.records.iter().find(|r| r.id() == id),
        ) {
            self.records[i] = PluginRecord {
                fingerprint: self.records[i].fingerprint.clone(),
                ..o.clone()
            };
        }
    }

    pub fn get(&self, id: &str) -> Option<&PluginRecord> {
        self.records
            .iter()
            .find(|r| r.id() == id && r.plugin().is_some())
            .or_else(|| self.records.iter().find(|r| r.id() == id))
    }

    /// Run `f` over this node's plugins as selection candidates and what a model of `format`
    /// and `architecture` (pinned to `pin`) wants, with the plugin ids by candidate index: a
    /// plugin this node refused is a candidate with its refusal.
    fn with_candidates<R>(
        &self,
        format: Format,
        architecture: &str,
        pin: Option<&str>,
        modalities: &[String],
        f: impl FnOnce(&[Candidate<'_>], &Wanted<'_>, &[String]) -> R,
    ) -> R {
        let ids: Vec<String> = self.records.iter().map(PluginRecord::id).collect();
        let none: Vec<String> = Vec::new();
        let candidates: Vec<Candidate<'_>> = self
            .records
            .iter()
            .zip(&ids)
            .map(|(r, id)| {
                let refused = match &r.state {
                    PluginState::Refused { label, reason } => {
                        Some((refusal_kind(label), format!("plugin not loaded: {reason}")))
                    }
                    PluginState::Loaded(_) => None,
                };
                let m = r.manifest.as_ref();
                Candidate {
                    name: id,
                    engine_id: id,
                    refused,
                    gpu_backend: m.map_or(self.backend.as_str(), |m| m.gpu_backend.as_str()),
                    formats: m.map_or(&none, |m| &m.formats),
                    modalities: m.map_or(&none, |m| &m.modalities),
                    architectures: m.map_or(&none, |m| &m.architectures),
                }
            })
            .collect();
        let want = Wanted {
            format: format.as_str(),
            modalities,
            architecture: Some(architecture),
            pin,
            backend: self.backend.as_str(),
            backend_note: "",
            pin_scope: "installed on this node",
        };
        f(&candidates, &want, &ids)
    }

    /// Which plugin serves a model of `format` and `architecture`, honouring an engine pin and
    /// the modalities the model is for (none: not checked), by the rules the operator applies
    /// too ([`gantry_api::selection`]): a plugin this node refused is a candidate with its
    /// refusal, so the verdict lists it with the reason.
    pub fn resolve(
        &self,
        format: Format,
        architecture: &str,
        pin: Option<&str>,
        modalities: &[String],
    ) -> EngineVerdict {
        let decide = |candidates: &[Candidate<'_>], want: &Wanted<'_>, ids: &[String]| {
            match select(candidates, want) {
                Selection::Chosen(i) => EngineVerdict::Supported {
                    plugin: ids[i].clone(),
                    version: self.records[i]
                        .plugin()
                        .map(|p| p.info().engine_version.clone())
                        .unwrap_or_default(),
                },
                Selection::Rejected(rejections) => EngineVerdict::Unsupported { rejections },
                // Unreachable with a known architecture; treated as "nothing chosen".
                Selection::Pending(_) => EngineVerdict::Unsupported {
                    rejections: Vec::new(),
                },
            }
        };
        self.with_candidates(format, architecture, pin, modalities, decide)
    }

    /// Every loaded plugin that passes the selection rules for a model of `format` and
    /// `architecture` with no pin, in engine id order ([`gantry_api::selection::passing`]):
    /// the candidates of an engine choice by measurement (node/engine_choice.rs) when there
    /// are several.
    pub fn alternatives(
        &self,
        format: Format,
        architecture: &str,
        modalities: &[String],
    ) -> Vec<String> {
        self.with_candidates(
            format,
            architecture,
            None,
            modalities,
            |candidates, want, ids| {
                passing(candidates, want)
                    .into_iter()
                    .map(|i| ids[i].clone())
                    .collect()
            },
        )
    }

    /// The loaded plugin behind a `Supported` verdict.
    pub fn plugin(&self, id: &str) -> Option<&Plugin> {
        self.records
            .iter()
            .filter(|r| r.id() == id)
            .find_map(PluginRecord::plugin)
    }
}

/// The rejection kind of a plugin the node refused, by its refusal label.
fn refusal_kind(label: &str) -> RejectionKind {
    match label {
        "abi_mismatch" => RejectionKind::Abi,
        "gpu_backend_mismatch" => RejectionKind::Backend,
        _ => RejectionKind::LoadError,
    }
}

/// Default plugin directory: `engines/` beside the running binary. A cargo
/// build of `gantry-engine-llama-cpp` lays out `target/<profile>/engines/`,
/// so `target/release/gantry-node` finds the plugins built in this workspace.
pub fn default_plugins_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("engines")))
        .unwrap_or_else(|| PathBuf::from("engines"))
}
