//! ModelPool reconcile, seen from a member (the Model reconcile calls it instead of building
//! pods, after validate): the member's own Deployment from before it joined goes, the pool's
//! template, read and admit steps say whether the pool serves it, and the pool pods that list
//! it are folded into its status with the Model's own fold, plus `status.pool` and the pool's
//! endpoint. A refused member gets `Ready=False` and `Degraded=True` with the pool's reason.

use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::admit;
use super::controller::RESYNC;
use super::plan::plan;
use super::status::{endpoint, pod_name};
use crate::context::Context;
use crate::model::error::Error;
use crate::model::resolve::Resolution;
use crate::model::validate::{self, ValidModel};
use crate::model::{apply, read, status as model_status};
use crate::node_report::NodeReport;
use gantry_crd::conditions::{self, Decided, FALSE, model as cond, reason};
use gantry_crd::{Model, ModelStatus, PoolPlacement};

/// A status that says the member is not served, and why (its pool is missing, or refused it).
fn refused_status(
    model: &Model,
    pool: &str,
    why: &'static str,
    message: String,
    ctx: &Context,
) -> ModelStatus {
    let previous = model.status.clone().unwrap_or_default();
    let generation = model.metadata.generation;
    let decided = [
        Decided::new(cond::READY, FALSE, why, message.clone()),
        Decided::new(cond::DEGRADED, conditions::TRUE, why, message),
    ];
    ModelStatus {
        observed_generation: generation,
        conditions: conditions::with_times(&decided, &previous.conditions, generation, ctx.now()),
        pool: Some(PoolPlacement {
            name: pool.to_string(),
            ..PoolPlacement::default()
        }),
        endpoint: None,
        replicas: None,
        autoscaling: None,
        ..previous
    }
}

/// The status of a pool member `valid` (spec.pool set): it owns no pods; the pool's pods
/// that list it speak for it. A member that moved into a pool loses its own Deployment.
pub async fn member_status(
    model: &Model,
    valid: &ValidModel,
    pool_name: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    let ns = valid.namespace.clone();
    // Pods of its own from before it joined go; its ConfigMap and Service stay until the
    // Model is deleted (they are inert without pods).
    let own = read::read(model, ctx).await;
    if own.deployment.is_some() {
        apply::apply(valid, None, &own, ctx).await?;
    }
    let Some(pool) = ctx.pool(&ns, pool_name) else {
        let status = refused_status(
            model,
            pool_name,
            reason::POOL_NOT_FOUND,
            format!(
                "spec.pool names the ModelPool `{pool_name}`, which does not exist in namespace `{ns}`"
            ),
            ctx,
        );
        model_status::publish(model, status, ctx).await?;
        return Ok(Action::await_change());
    };
    let template = match admit::template(&pool, &ctx.settings) {
        Ok(t) => t,
        Err(problems) => {
            let status = refused_status(
                model,
                pool_name,
                reason::INVALID_SPEC,
                format!(
                    "the ModelPool `{pool_name}` is invalid: {}",
                    validate::message(&problems)
                ),
                ctx,
            );
            model_status::publish(model, status, ctx).await?;
            return Ok(Action::await_change());
        }
    };
    let plan = plan(&pool, template, ctx).await?;
    let name = model.name_any();
    let Some(member) = plan.admission.member(&name) else {
        let (why, message) = match plan.admission.refusal(&name) {
            Some(r) => (
                conditions_reason(&r.reason),
                format!("the ModelPool `{pool_name}` refuses it: {}", r.message),
            ),
            None => (
                reason::POOL_NOT_FOUND,
                format!("the ModelPool `{pool_name}` does not list it yet"),
            ),
        };
        let status = refused_status(model, pool_name, why, message, ctx);
        model_status::publish(model, status, ctx).await?;
        return Ok(Action::requeue(RESYNC));
    };
    // The pool's pods running a config that lists the member speak for it.
    let listing: Vec<&NodeReport> = plan
        .observed
        .reports
        .iter()
        .filter(|r| r.model(&valid.served_name).is_some())
        .collect();
    let resolution: &Resolution = &member.resolution;
    let facts = model_status::Facts {
        model,
        valid: &member.valid,
        architecture: member.architecture.as_deref(),
        resolution,
        deployment: plan.observed.deployment.as_ref(),
        reports: &listing,
        apply_error: None,
        deliveries: &[],
        deliver_error: None,
        now: ctx.now(),
    };
    let mut folded = model_status::fold(&facts);
    folded.endpoint = plan.observed.deployment.is_some().then(|| endpoint(&pool));
    folded.pool = Some(PoolPlacement {
        name: pool_name.to_string(),
        listed_by: listing.iter().map(|r| pod_name(&r.pod)).collect(),
        loaded_on: listing
            .iter()
            .filter(|r| {
                r.model(&valid.served_name)
                    .is_some_and(|m| m.load.state == gantry_api::LoadState::Loaded)
            })
            .map(|r| pod_name(&r.pod))
            .collect(),
    });
    model_status::publish(model, folded, ctx).await?;
    Ok(Action::requeue(RESYNC))
}

/// The reason constant for a refusal reason string (always one of ours).
fn conditions_reason(r: &str) -> &'static str {
    [
        reason::INVALID_SPEC,
        reason::ENGINE_UNRESOLVED,
        reason::DOES_NOT_FIT,
        reason::SERVED_NAME_TAKEN,
    ]
    .into_iter()
    .find(|k| *k == r)
    .unwrap_or(reason::INVALID_SPEC)
}
