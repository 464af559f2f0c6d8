//! ModelPool reconcile, read → admit → render → build (before apply): what one pool reconcile
//! decides, up to the objects to apply. A member's own reconcile runs the same plan to learn
//! whether, and how, the pool serves it.

use kube::ResourceExt;

use super::admit;
use crate::context::Context;
use crate::model::build;
use crate::model::error::Error;
use crate::model::node_config::RenderedConfig;
use crate::model::read::{Observed, read_objects};
use crate::model::validate::ValidModel;
use gantry_crd::{CacheType, ModelPool};

/// Everything one pool reconcile decided, up to the objects to apply.
pub struct Plan {
    pub template: ValidModel,
    pub observed: Observed,
    pub admission: admit::Admission,
    pub config: admit::PoolConfig,
    /// `None`: no member can be served; the pool runs no pods.
    pub desired: Option<build::OwnedObjects>,
}

/// The read, admit, render and build steps for `pool` with its pod `template`.
pub async fn plan(pool: &ModelPool, template: ValidModel, ctx: &Context) -> Result<Plan, Error> {
    let ns = pool.namespace().unwrap_or_default();
    let wants_claim = template.cache.type_ == CacheType::PersistentVolumeClaim;
    let observed = read_objects(&ns, &template.name, wants_claim, ctx).await;
    let plugins = admit::allowed_plugins(pool, ctx.engine_plugins());
    let members = ctx.pool_members(&ns, &pool.name_any());
    let admission = admit::admit(
        pool,
        &template,
        &members,
        &observed.reports,
        &plugins,
        &ctx.settings,
    );
    let config = admit::render(pool, &admission)?;
    let mounted = admission.mounted();
    let desired = if admission.members.is_empty() || mounted.is_empty() {
        None
    } else {
        // The pod template carries the hash of what a pod cannot reload; the ConfigMap the
        // whole config.
        let pod_config = RenderedConfig {
            yaml: config.config.yaml.clone(),
            hash: config.pod_hash.clone(),
        };
        let mut objects = build::assemble(&template, &pod_config, &mounted, &ctx.settings)?;
        // As for a Model: a new image of a plugin the pods take in place does not roll them.
        build::hold_plugin_images(&mut objects, observed.deployment.as_ref())?;
        Some(objects)
    };
    Ok(Plan {
        template,
        observed,
        admission,
        config,
        desired,
    })
}
