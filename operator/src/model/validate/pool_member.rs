//! Model reconcile, validate step (pure): what a Model with `spec.pool` may not set — the
//! fields that shape node pods belong to its ModelPool, and a source (the base's or an
//! adapter's) that needs a per-model volume or Secret cannot join the pool's pods.

use super::adapter::ValidAdapter;
use super::invalid::Invalid;
use super::source::ValidSource;
use gantry_crd::Model;

/// A pool member leaves the pod template to its pool: the fields that shape node pods are
/// refused on it, and so are sources that need a per-model volume or Secret in the pod.
pub(super) fn check_pool_member(
    model: &Model,
    pool: &str,
    source: Option<&ValidSource>,
    adapters: &[ValidAdapter],
    problems: &mut Vec<Invalid>,
) {
    let spec = &model.spec;
    let resources = spec.resources.clone().unwrap_or_default();
    for (field, set) in [
        ("spec.replicas", spec.replicas.is_some()),
        ("spec.autoscaling", spec.autoscaling.is_some()),
        ("spec.rollout", spec.rollout.is_some()),
        ("spec.scheduling", spec.scheduling.is_some()),
        ("spec.cache", spec.cache.is_some()),
        ("spec.resources.gpus", resources.gpus.is_some()),
        (
            "spec.resources.gpuResourceName",
            resources.gpu_resource_name.is_some(),
        ),
        ("spec.resources.cpu", resources.cpu.is_some()),
    ] {
        if set {
            problems.push(Invalid::new(
                field,
                format!("belongs to the ModelPool `{pool}` for a member of it; set it there, or remove spec.pool"),
            ));
        }
    }
    if let Some(claim) = source.and_then(|s| s.claim.as_ref()) {
        problems.push(Invalid::new(
            "spec.source.uri",
            format!("a pvc:// source (claim `{claim}`) cannot join a pool: the pool's pods mount no per-model claims; use hf://, s3://, https:// or a file:// path on the pool's cache"),
        ));
    }
    if source.is_some_and(|s| s.secret.is_some()) {
        problems.push(Invalid::new(
            "spec.source.secretRef",
            "a source with a Secret cannot join a pool: the pool's pods carry no per-model credentials",
        ));
    }
    for a in adapters {
        if let Some(claim) = &a.claim {
            problems.push(Invalid::at(
                format!("spec.adapters[{}].source.uri", a.name),
                format!("a pvc:// source (claim `{claim}`) cannot join a pool: the pool's pods mount no per-model claims; use hf://, s3://, https:// or a file:// path on the pool's cache"),
            ));
        }
    }
    for a in &model.spec.adapters {
        if a.source.secret_ref.is_some() {
            problems.push(Invalid::at(
                format!("spec.adapters[{}].source.secretRef", a.name),
                "a source with a Secret cannot join a pool: the pool's pods carry no per-model credentials",
            ));
        }
    }
}
