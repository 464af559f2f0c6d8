//! EnginePlugin acceptance (pure, no client), shared by two reconciles: the EnginePlugin
//! reconcile's validate step decides `Accepted` with it, and the Model reconcile's resolve step
//! refuses a candidate with it, so `model/` and `plugin/` need nothing from each other.
//!
//! A plugin is accepted when its spec passes the manifest rules the node
//! applies (semver version, engine id, sha256 form, non-empty formats and
//! architectures), its ABI major is the node image's, and no EnginePlugin
//! earlier by name already provides the same engine id for the same backend
//! (both would be copied to the same directory on a node).

use kube::ResourceExt;

use gantry_api::RejectionKind;
use gantry_crd::conditions::reason;

use gantry_crd::{EnginePlugin, EnginePluginSpec};

/// Why a plugin is not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error(
        "ABI version mismatch: the node image supports ABI {expected}, the plugin declares {got}"
    )]
    AbiMismatch { expected: u32, got: i32 },
    #[error("engine {engine_id} for {backend} is already provided by EnginePlugin {other}")]
    EngineIdConflict {
        engine_id: String,
        backend: &'static str,
        other: String,
    },
}

impl Refusal {
    /// The `Accepted=False` condition reason.
    pub fn condition_reason(&self) -> &'static str {
        match self {
            Refusal::Invalid { .. } => reason::INVALID_SPEC,
            Refusal::AbiMismatch { .. } => reason::ABI_MISMATCH,
            Refusal::EngineIdConflict { .. } => reason::ENGINE_ID_CONFLICT,
        }
    }

    /// How a Model lists this plugin among its rejected candidates (the node's categories).
    pub fn rejection(&self) -> RejectionKind {
        match self {
            Refusal::AbiMismatch { .. } => RejectionKind::Abi,
            Refusal::Invalid { .. } | Refusal::EngineIdConflict { .. } => RejectionKind::LoadError,
        }
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Refusal::Invalid { .. } => "invalid_spec",
            Refusal::AbiMismatch { .. } => "abi_mismatch",
            Refusal::EngineIdConflict { .. } => "engine_id_conflict",
        }
    }
}

/// The spec on its own: the manifest's rules, then the ABI (the node checks the ABI first of
/// all; here a malformed spec is reported before it because its ABI field may be the typo).
pub fn check_spec(spec: &EnginePluginSpec, abi_major: u32) -> Result<(), Refusal> {
    let invalid = |field, message: String| Err(Refusal::Invalid { field, message });
    if !is_engine_id(&spec.engine_id) {
        return invalid(
            "spec.engineId",
            format!(
                "must be lower-case letters, digits, _ and -, got {:?}",
                spec.engine_id
            ),
        );
    }
    if !gantry_engine_abi::is_semver(&spec.version) {
        return invalid(
            "spec.version",
            format!("must be MAJOR.MINOR.PATCH, got {:?}", spec.version),
        );
    }
    if spec.image.trim().is_empty() || spec.image.contains(char::is_whitespace) {
        return invalid(
            "spec.image",
            format!("must be an image reference, got {:?}", spec.image),
        );
    }
    if spec.formats.is_empty() {
        return invalid("spec.formats", "must list at least one format".to_string());
    }
    if spec.architectures.is_empty() {
        return invalid(
            "spec.architectures",
            "must list at least one architecture (the node refuses a plugin without any)"
                .to_string(),
        );
    }
    if let Some(sha) = &spec.sha256
        && (sha.len() != 64 || !sha.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
    {
        return invalid(
            "spec.sha256",
            "must be 64 lower-case hex digits".to_string(),
        );
    }
    let path = spec.library_path();
    if !path.starts_with('/') || path.split('/').any(|s| s == "..") {
        return invalid(
            "spec.libraryPath",
            format!("must be an absolute path without `..`, got {path:?}"),
        );
    }
    if u32::try_from(spec.abi_version).ok() != Some(abi_major) {
        return Err(Refusal::AbiMismatch {
            expected: abi_major,
            got: spec.abi_version,
        });
    }
    Ok(())
}

/// `plugin` among `all`: its spec, then engine-id conflicts with plugins earlier by name.
pub fn accept(plugin: &EnginePlugin, all: &[EnginePlugin], abi_major: u32) -> Result<(), Refusal> {
    check_spec(&plugin.spec, abi_major)?;
    let name = plugin.name_any();
    let earlier = all
        .iter()
        .filter(|o| o.name_any() < name)
        .filter(|o| {
            o.spec.engine_id == plugin.spec.engine_id
                && o.spec.gpu_backend == plugin.spec.gpu_backend
        })
        .filter(|o| check_spec(&o.spec, abi_major).is_ok())
        .map(ResourceExt::name_any)
        .min();
    match earlier {
        Some(other) => Err(Refusal::EngineIdConflict {
            engine_id: plugin.spec.engine_id.clone(),
            backend: plugin.spec.gpu_backend.as_str(),
            other,
        }),
        None => Ok(()),
    }
}

/// Engine ids as plugin manifests spell them: `[a-z0-9][a-z0-9_-]*`, at most 63.
pub fn is_engine_id(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
}
