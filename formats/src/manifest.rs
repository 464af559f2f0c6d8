//! Engine host, discovery step (before a plugin library is opened): parses and validates one
//! plugin's `manifest.json`.
//!
//! The schema and the refusal messages are those of the engine specification
//! (seeds 002, "validation rules"); each rule is checked in the order the
//! table lists them, before the library is opened.

use std::path::{Path, PathBuf};

use gantry_engine_abi::{Backend, Format};
use serde::{Deserialize, Serialize};

/// A parsed `manifest.json`, as on disk.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PluginManifest {
    #[serde(rename = "$schema", default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    pub id: String,
    pub version: String,
    pub abi_version: String,
    pub gpu_backend: String,
    pub binary: String,
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub formats: Vec<String>,
    #[serde(default)]
    pub modalities: Vec<String>,
    #[serde(default)]
    pub supports_vision: bool,
    #[serde(default)]
    pub license: Option<String>,
    /// Optional pin of the library's sha256 (lower-case hex); a mismatch is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// Why a manifest was refused. Display strings are the specification's messages.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("Invalid manifest {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("ABI version mismatch: expected {expected}, got {got}")]
    AbiMismatch { expected: u32, got: String },
    #[error("GPU backend mismatch")]
    BackendMismatch { host: Backend, plugin: String },
    #[error("No architectures specified")]
    NoArchitectures,
    #[error("Plugin ID conflict: {0} already loaded")]
    IdConflict(String),
    #[error("Binary not found: {}", .0.display())]
    BinaryNotFound(PathBuf),
    #[error("sha256 mismatch for {}: expected {expected}, got {got}", .path.display())]
    Sha256Mismatch {
        path: PathBuf,
        expected: String,
        got: String,
    },
}

impl ManifestError {
    /// Stable label for metrics and status reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ManifestError::Invalid { .. } => "invalid_manifest",
            ManifestError::AbiMismatch { .. } => "abi_mismatch",
            ManifestError::BackendMismatch { .. } => "gpu_backend_mismatch",
            ManifestError::NoArchitectures => "no_architectures",
            ManifestError::IdConflict(_) => "id_conflict",
            ManifestError::BinaryNotFound(_) => "binary_not_found",
            ManifestError::Sha256Mismatch { .. } => "sha256_mismatch",
        }
    }
}

/// Real manifests are a few KiB (the architecture list dominates); anything
/// beyond this is refused before parsing.
pub const MAX_MANIFEST_BYTES: usize = 1 << 20;

const KNOWN_BACKENDS: [&str; 2] = ["cpu", "cuda"];
const KNOWN_FORMATS: [&str; 3] = ["gguf", "safetensors", "onnx"];
/// The ABI's modality bits by name (`GANTRY_MODALITY_*`, ABI 1.9): `speech`, `vision` and
/// `image` are declared, and no engine implements them yet.
const KNOWN_MODALITIES: [&str; 6] = [
    "completion",
    "embedding",
    "transcription",
    "speech",
    "vision",
    "image",
];

impl PluginManifest {
    /// Parse a manifest file; schema violations (types, required fields,
    /// patterns, enums) are `Invalid` with the offending field named.
    pub fn read(path: &Path) -> Result<Self, ManifestError> {
        let invalid = |reason: String| ManifestError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let len = std::fs::metadata(path)
            .map_err(|e| invalid(format!("cannot read: {e}")))?
            .len();
        if len > MAX_MANIFEST_BYTES as u64 {
            return Err(invalid(format!(
                "the file is {len} bytes; a manifest must be <= {MAX_MANIFEST_BYTES} bytes"
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| invalid(format!("cannot read: {e}")))?;
        Self::parse(&bytes).map_err(invalid)
    }

    /// Parse and schema-check manifest bytes; the error is the reason, naming
    /// the field. Pure (no file system), so the fuzz target calls it directly.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(format!(
                "the file is {} bytes; a manifest must be <= {MAX_MANIFEST_BYTES} bytes",
                bytes.len()
            ));
        }
        let m: PluginManifest = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        m.check_schema()?;
        Ok(m)
    }

    /// The JSON-schema part of the specification: patterns and enums.
    pub fn check_schema(&self) -> Result<(), String> {
        if self.id.is_empty() {
            return Err("`id` must not be empty".into());
        }
        if !gantry_engine_abi::is_semver(&self.version) {
            return Err(format!(
                "`version` must match ^\\d+\\.\\d+\\.\\d+$, got {:?}",
                self.version
            ));
        }
        if self.abi_version.is_empty() || !self.abi_version.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "`abi_version` must match ^\\d+$, got {:?}",
                self.abi_version
            ));
        }
        if !KNOWN_BACKENDS.contains(&self.gpu_backend.as_str()) {
            return Err(format!(
                "`gpu_backend` must be one of {KNOWN_BACKENDS:?}, got {:?}",
                self.gpu_backend
            ));
        }
        if self.binary.is_empty() {
            return Err("`binary` must not be empty".into());
        }
        if let Some(f) = self
            .formats
            .iter()
            .find(|f| !KNOWN_FORMATS.contains(&f.as_str()))
        {
            return Err(format!(
                "`formats` items must be one of {KNOWN_FORMATS:?}, got {f:?}"
            ));
        }
        if let Some(m) = self
            .modalities
            .iter()
            .find(|m| !KNOWN_MODALITIES.contains(&m.as_str()))
        {
            return Err(format!(
                "`modalities` items must be one of {KNOWN_MODALITIES:?}, got {m:?}"
            ));
        }
        if let Some(s) = &self.sha256
            && (s.len() != 64 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        {
            return Err("`sha256` must be 64 lower-case hex digits".into());
        }
        Ok(())
    }

    /// The specification's validation table, in its order (the id-conflict
    /// rule needs the set of already loaded ids).
    pub fn validate(
        &self,
        manifest_dir: &Path,
        host_backend: Backend,
        loaded: &[String],
    ) -> Result<PathBuf, ManifestError> {
        let expected = gantry_engine_abi::ffi::GANTRY_ABI_MAJOR;
        if self.abi_version != expected.to_string() {
            return Err(ManifestError::AbiMismatch {
                expected,
                got: self.abi_version.clone(),
            });
        }
        if loaded.iter().any(|id| id == &self.id) {
            return Err(ManifestError::IdConflict(self.id.clone()));
        }
        let binary = manifest_dir.join(&self.binary);
        if !binary.is_file() {
            return Err(ManifestError::BinaryNotFound(binary));
        }
        if self.architectures.is_empty() {
            return Err(ManifestError::NoArchitectures);
        }
        if self.gpu_backend != host_backend.as_str() {
            return Err(ManifestError::BackendMismatch {
                host: host_backend,
                plugin: self.gpu_backend.clone(),
            });
        }
        Ok(binary)
    }

    pub fn backend(&self) -> Option<Backend> {
        Backend::parse(&self.gpu_backend)
    }

    pub fn supports_format(&self, format: Format) -> bool {
        self.formats.iter().any(|f| f == format.as_str())
    }

    pub fn supports_architecture(&self, arch: &str) -> bool {
        self.architectures.iter().any(|a| a == arch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> PluginManifest {
        PluginManifest {
            schema: None,
            id: "x".into(),
            version: "1.2.3".into(),
            abi_version: "1".into(),
            gpu_backend: "cpu".into(),
            binary: "lib.so".into(),
            architectures: vec!["llama".into()],
            formats: vec!["gguf".into()],
            modalities: vec!["completion".into()],
            supports_vision: false,
            license: Some("MIT".into()),
            sha256: None,
        }
    }

    #[test]
    fn schema_rejects_bad_version_backend_format_and_modality() {
        type Mutation = fn(&mut PluginManifest);
        let cases: [(Mutation, &str); 7] = [
            (|m| m.version = "1.2".into(), "`version`"),
            (|m| m.abi_version = "v1".into(), "`abi_version`"),
            (|m| m.gpu_backend = "metal".into(), "`gpu_backend`"),
            (|m| m.formats = vec!["tflite".into()], "`formats`"),
            (|m| m.modalities = vec!["video".into()], "`modalities`"),
            (|m| m.sha256 = Some("abc".into()), "`sha256`"),
            (|m| m.id = String::new(), "`id`"),
        ];
        for (mutate, field) in cases {
            let mut m = base();
            mutate(&mut m);
            let err = m.check_schema().expect_err(field);
            assert!(err.contains(field), "{err} should name {field}");
        }
        assert!(base().check_schema().is_ok());
        // ABI 1.9's modalities, declared ones included.
        let mut m = base();
        m.modalities = KNOWN_MODALITIES.map(String::from).to_vec();
        assert!(m.check_schema().is_ok());
    }

    #[test]
    fn parse_refuses_oversized_and_malformed_bytes_with_a_reason() {
        let big = vec![b' '; MAX_MANIFEST_BYTES + 1];
        let err = PluginManifest::parse(&big).expect_err("too big");
        assert!(err.contains("must be <= 1048576 bytes"), "{err}");
        let err = PluginManifest::parse(b"{\"id\": \"x\"").expect_err("truncated");
        assert!(err.contains("EOF"), "{err}");
        let err = PluginManifest::parse(b"{\"id\": 3}").expect_err("wrong type");
        assert!(err.contains("invalid type"), "{err}");
        let ok = serde_json::to_vec(&base()).expect("json");
        assert_eq!(PluginManifest::parse(&ok).expect("valid"), base());
    }

    #[test]
    fn unknown_fields_and_missing_required_fields_are_invalid() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("manifest.json");
        std::fs::write(
            &p,
            r#"{"id":"x","version":"1.0.0","abi_version":"1","gpu_backend":"cpu"}"#,
        )
        .expect("write");
        let err = PluginManifest::read(&p).expect_err("binary is required");
        assert!(err.to_string().contains("missing field `binary`"), "{err}");
        std::fs::write(
            &p,
            r#"{"id":"x","version":"1.0.0","abi_version":"1","gpu_backend":"cpu","binary":"a","bogus":1}"#,
        )
        .expect("write");
        let err = PluginManifest::read(&p).expect_err("unknown field");
        assert!(err.to_string().contains("unknown field `bogus`"), "{err}");
    }
}
