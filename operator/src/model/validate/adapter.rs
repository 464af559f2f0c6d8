//! Model reconcile, validate step (pure): `spec.adapters`, each by the rules the node applies
//! too (`gantry_api::config::AdapterConfig::check`) and the base source's grammar and cluster
//! policy (`validate/source.rs`), plus what only the Model can tell: served ids that collide
//! with the Model's own or each other's, and the one source credential node pods hold.
//!
//! Field paths name the entry by its name, as the node does: `spec.adapters[pirate].scale`.

use std::collections::HashSet;

use gantry_api::config::{MAX_ADAPTERS, check_adapter_name};
use gantry_api::source::{Source, check_relative_file, is_dns1123_subdomain};

use super::grammar::is_served_name;
use super::invalid::Invalid;
use super::source::ValidSource;
use gantry_crd::Adapter;
use gantry_crd::model::MAX_ADAPTER_SCALE;

/// A validated adapter.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidAdapter {
    /// `spec.adapters[].name`.
    pub name: String,
    /// The OpenAI model id it is served under: its `servedName`, else `<model id>:<name>`.
    pub id: String,
    /// `servedName` as written.
    pub served_name: Option<String>,
    /// `source.uri` as written.
    pub uri: String,
    /// What the node is told to fetch (a `pvc://` source becomes `file:///models/claim/path`).
    pub node_uri: String,
    /// `pvc://` sources: the claim to mount.
    pub claim: Option<String>,
    pub files: Vec<String>,
    /// `scale` as the node takes it; absent = 1.
    pub scale: Option<f32>,
}

impl ValidAdapter {
    pub fn is_hugging_face(&self) -> bool {
        self.uri.starts_with("hf://")
    }

    pub fn is_s3(&self) -> bool {
        self.uri.starts_with("s3://")
    }
}

/// Validate every adapter of a Model served as `served_name` whose base source is `base`
/// (`None` when the base source itself is invalid: the credential rule is skipped then).
pub(super) fn validate_adapters(
    adapters: &[Adapter],
    served_name: &str,
    base: Option<&ValidSource>,
    problems: &mut Vec<Invalid>,
) -> Vec<ValidAdapter> {
    if adapters.len() > MAX_ADAPTERS {
        problems.push(Invalid::new(
            "spec.adapters",
            format!("lists {} adapters; at most {MAX_ADAPTERS}", adapters.len()),
        ));
    }
    let mut names = HashSet::new();
    // Every id the Model's pods serve names one thing: the base's, then each adapter's.
    let mut ids = HashSet::from([served_name.to_string()]);
    let mut valid = Vec::with_capacity(adapters.len());
    for a in adapters {
        let at = |field: &str| format!("spec.adapters[{}].{field}", a.name);
        let before = problems.len();
        if let Err(reason) = check_adapter_name(&a.name) {
            problems.push(Invalid::at(at("name"), reason));
        } else if !names.insert(a.name.as_str()) {
            problems.push(Invalid::at(at("name"), "appears twice"));
        }
        let source = validate_source(a, base, &at, problems);
        if let Some(s) = a.scale
            && !(s.is_finite() && s > 0.0 && s <= MAX_ADAPTER_SCALE)
        {
            problems.push(Invalid::at(
                at("scale"),
                format!("must be within (0, {MAX_ADAPTER_SCALE}], got {s}"),
            ));
        }
        let id = a.model_id(served_name);
        if let Some(s) = &a.served_name
            && !is_served_name(s)
        {
            problems.push(Invalid::at(
                at("servedName"),
                format!("must be 1-128 characters of letters, digits and . _ : / -, starting with a letter or digit, got {s:?}"),
            ));
        } else if id == served_name {
            problems.push(Invalid::at(
                at("servedName"),
                format!("{id:?} is the Model's own served name; an adapter needs an id of its own"),
            ));
        } else if !is_served_name(&id) {
            problems.push(Invalid::at(
                at("name"),
                format!("the adapter would be served as {id:?}, longer than a model id's 128 characters; set a shorter servedName"),
            ));
        } else if !ids.insert(id.clone()) {
            problems.push(Invalid::at(
                at("servedName"),
                format!("{id:?} is already the id of another adapter of this Model"),
            ));
        }
        if let Some((node_uri, claim)) = source
            && problems.len() == before
        {
            valid.push(ValidAdapter {
                name: a.name.clone(),
                id,
                served_name: a.served_name.clone(),
                uri: a.source.uri.trim().to_string(),
                node_uri,
                claim,
                files: a.source.files.clone(),
                // Within (0, 16] by now: exact enough in f32, the node's type.
                scale: a.scale.map(|s| s as f32),
            });
        }
    }
    valid
}

/// The adapter's source by the base source's grammar and cluster policy: the node URI and the
/// claim to mount. An adapter is one set of weights, so a `:QUANT` suffix is refused, and
/// node pods hold one source credential, so a `secretRef` must be the base's.
fn validate_source(
    a: &Adapter,
    base: Option<&ValidSource>,
    at: &dyn Fn(&str) -> String,
    problems: &mut Vec<Invalid>,
) -> Option<(String, Option<String>)> {
    let src = &a.source;
    let uri = src.uri.trim();
    let mut out = None;
    match Source::parse(uri).and_then(|s| s.check_cluster_policy(uri).map(|()| s)) {
        Ok(Source::Hf {
            quantization: Some(q),
            ..
        }) => problems.push(Invalid::at(
            at("source.uri"),
            format!("an adapter is one set of weights: drop the quantization suffix `:{q}`"),
        )),
        Ok(source) => {
            let claim = match &source {
                Source::Pvc { claim, .. } => Some(claim.clone()),
                _ => None,
            };
            out = Some((source.node_uri(uri), claim));
        }
        Err(e) => problems.push(Invalid::at(at("source.uri"), e.reason)),
    }
    for f in &src.files {
        if let Err(message) = check_relative_file(f) {
            problems.push(Invalid::at(at("source.files"), message));
        }
    }
    if let Some(r) = &src.secret_ref {
        let key = r.key.clone().unwrap_or_else(|| "token".to_string());
        if !is_dns1123_subdomain(&r.name) {
            problems.push(Invalid::at(
                at("source.secretRef.name"),
                format!("must be a Secret name, got {:?}", r.name),
            ));
        } else if let Some(base) = base {
            // The node reads its source token (and S3 keys) from its environment, once for
            // every download; a second Secret would have nowhere to go.
            match &base.secret {
                Some((name, base_key)) if *name == r.name && *base_key == key => {}
                Some((name, base_key)) => problems.push(Invalid::at(
                    at("source.secretRef"),
                    format!(
                        "names Secret {:?} key {key:?}, but node pods hold one source credential, spec.source.secretRef's (Secret {name:?} key {base_key:?}); use that one or leave it out",
                        r.name
                    ),
                )),
                None => problems.push(Invalid::at(
                    at("source.secretRef"),
                    format!(
                        "node pods hold one source credential, spec.source.secretRef's, which is not set; set spec.source.secretRef to Secret {:?} key {key:?} (the base model's download then uses it too) and leave this out",
                        r.name
                    ),
                )),
            }
        }
    }
    out
}
