//! Model reconcile, validate step (pure): `spec.source` by the grammar the node applies too
//! (`gantry_api::source`), plus the cluster policy (no plain `http://`; `pvc://` becomes a
//! read-only mount of the claim and a `file://` URI for the node), its files and its Secret.

use gantry_api::source::is_dns1123_subdomain;
use gantry_api::source::{Source, check_relative_file};

use super::invalid::Invalid;
use gantry_crd::Model;

/// A validated source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidSource {
    /// `spec.source.uri` as written.
    pub uri: String,
    /// What the node is told to fetch: the URI, except `pvc://claim/path`, which becomes
    /// `file:///models/claim/path` on a read-only mount of the claim.
    pub node_uri: String,
    /// `pvc://` sources: the claim to mount.
    pub claim: Option<String>,
    pub files: Vec<String>,
    pub quantization: Option<String>,
    /// Secret name and key of the source token.
    pub secret: Option<(String, String)>,
}

impl ValidSource {
    /// What `status.observedSource` records: the URI plus `@quantization` when set.
    pub fn key(&self) -> String {
        match &self.quantization {
            Some(q) => format!("{} ({q})", self.uri),
            None => self.uri.clone(),
        }
    }

    pub fn is_hugging_face(&self) -> bool {
        self.uri.starts_with("hf://")
    }

    pub fn is_s3(&self) -> bool {
        self.uri.starts_with("s3://")
    }
}

/// The URI by the grammar the node applies too (`gantry_api::source`), plus the one cluster
/// policy (no plain `http://`). `pvc://` sources are rewritten to a read-only mount of the
/// claim, so the node only ever sees `file://`.
pub(super) fn validate_source(model: &Model) -> Result<ValidSource, Vec<Invalid>> {
    let src = &model.spec.source;
    let uri = src.uri.trim();
    let mut problems = Vec::new();
    let mut claim = None;
    let mut node_uri = uri.to_string();
    match Source::parse(uri).and_then(|s| s.check_cluster_policy(uri).map(|()| s)) {
        Ok(source) => {
            node_uri = source.node_uri(uri);
            if let Source::Pvc { claim: c, .. } = &source {
                claim = Some(c.clone());
            }
        }
        Err(e) => problems.push(Invalid::new("spec.source.uri", e.reason)),
    }
    for f in &src.files {
        if let Err(message) = check_relative_file(f) {
            problems.push(Invalid::new("spec.source.files", message));
        }
    }
    let secret = src.secret_ref.as_ref().map(|r| {
        (
            r.name.clone(),
            r.key.clone().unwrap_or_else(|| "token".to_string()),
        )
    });
    if let Some((name, _)) = &secret
        && !is_dns1123_subdomain(name)
    {
        problems.push(Invalid::new(
            "spec.source.secretRef.name",
            format!("must be a Secret name, got {name:?}"),
        ));
    }
    if problems.is_empty() {
        Ok(ValidSource {
            uri: uri.to_string(),
            node_uri,
            claim,
            files: src.files.clone(),
            quantization: src.quantization.clone(),
            secret,
        })
    } else {
        Err(problems)
    }
}
