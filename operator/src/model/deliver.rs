//! Model reconcile, deliver step (after apply, before status): brings a new version of an
//! EnginePlugin to the running node pods without restarting them.
//!
//! It applies to plugins mounted by an init container and run in `process` isolation
//! (`build::pod::in_place_slots`): the node shadow-loads a changed library in new workers and
//! switches with no failed request (docs/engines.md, "Plugin updates without downtime"). When
//! such a plugin's image is all that changed, the build step keeps the old image in the pod
//! template (`build::hold_plugin_images`: no rollout), and this step adds an ephemeral
//! container to each pod that runs the new image's `/copy` into the pod's engines volume. An
//! ephemeral container leaves the pod's readiness alone (a restarted sidecar would take the
//! pod out of its Service while the new image is pulled) and needs no change to the template.
//!
//! Pacing, per plugin: one pod first; once a pod runs the new version, up to a quarter of the
//! pods at a time (at least one), counting those still on their way. A pod gets a copy only
//! while it runs and its node serves (a starting pod's init container could copy the older
//! image after it), and never while an earlier copy into it is still on its way (two copies
//! must not write one directory at once). A pod is done when its copy finished and its node
//! reports the version applied after that (or, restarted since, runs it). A pod whose node
//! refused the new version, or whose copy failed (the image cannot be pulled, `/copy` exited
//! non-zero), halts the delivery: the other pods keep the version they run, and the Model (or
//! the pool, for a pool's pods) says why (`Degraded`, `PluginUpdateHalted`) until the
//! EnginePlugin changes again. The pure [`plan`] decides; [`deliver`] writes what it decided;
//! [`deliver_plugins`], the step's entry for the Model and ModelPool reconciles, picks the
//! slots and the pods.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ContainerState, EphemeralContainer, Pod};

use crate::node_pod::{ContainerImage, NodePod};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::Api;

use super::build::OwnedObjects;
use super::build::pod::{
    copy_command, engines_mount, in_place_slots, restricted_container_security,
};
use super::controller::CONTROLLER;
use super::read::Observed;
use super::validate::ValidModel;
use crate::context::{Context, PluginDelivery};
use crate::node_report::NodeReport;
use crate::write::{self, Retry, classify};
use gantry_crd::EnginePlugin;
use gantry_crd::names::{ANNOTATION_CONFIG_HASH, ANNOTATION_PLUGINS, ANNOTATION_POD_SPEC_HASH};

/// The template annotations that tell a pod of the Deployment's current template from one a
/// rollout is replacing (which gets no delivery: its replacement carries the new image).
pub const TEMPLATE_KEYS: [&str; 3] = [
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_PLUGINS,
    ANNOTATION_POD_SPEC_HASH,
];

/// One plugin delivered in place: its init container's name in the pods, and the plugin.
#[derive(Clone, Debug)]
pub struct Slot<'a> {
    pub container: String,
    pub plugin: &'a EnginePlugin,
}

/// Where one pod stands with one plugin's new version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodState {
    /// Its node runs the new version.
    Done,
    /// The new image is in the pod (copying, or the node is shadow-loading it).
    InFlight,
    /// The copy failed or the node refused the version: the reason.
    Failed(String),
    /// Still on an older image; `serving` says whether it is running and its node serves
    /// (only then does it get a copy); `ordinal` numbers its last copy container.
    Stale { serving: bool, ordinal: usize },
}

/// A pod the plan delivers to, and the ephemeral container's name there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub pod: String,
    pub container: String,
}

/// What the deliver step found and did for one plugin, for the Model's or pool's status
/// (`model::status::rollout`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeliveryProgress {
    /// The EnginePlugin's name and version.
    pub plugin: String,
    pub version: String,
    /// Pods of the current template that mount it.
    pub pods: usize,
    /// Pods whose node runs `version`.
    pub done: usize,
    /// The first pod that failed, and why: the delivery is halted.
    pub halted: Option<(String, String)>,
}

impl DeliveryProgress {
    /// Whether pods are still to receive the version (and nothing halted it).
    pub fn delivering(&self) -> bool {
        self.halted.is_none() && self.done < self.pods
    }
}

/// Waiting reasons of a container whose image cannot be run: the copy will not happen.
const STUCK: [&str; 5] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
];

/// The ephemeral containers of `pod` that delivered `slot`, in order: `{slot}-u{n}`.
fn deliveries<'p>(pod: &'p NodePod, slot: &str) -> Vec<(usize, &'p ContainerImage)> {
    let prefix = format!("{}-u", slot_prefix(slot));
    let mut out: Vec<(usize, &ContainerImage)> = pod
        .spec
        .iter()
        .flat_map(|s| s.ephemeral_containers.iter().flatten())
        .filter_map(|c| {
            let n = c.name.strip_prefix(&prefix)?.parse::<usize>().ok()?;
            Some((n, c))
        })
        .collect();
    out.sort_by_key(|(n, _)| *n);
    out
}

/// The slot name cut so that `-u{n}` still fits a container name (≤ 63).
fn slot_prefix(slot: &str) -> &str {
    let end = slot.len().min(56);
    slot[..end].trim_end_matches('-')
}

/// What `pod` last received for `slot`: the image, the state of the delivery's container
/// (`None`: the init container, or no status yet) and the delivery's number (0: the init
/// container).
fn current<'p>(
    pod: &'p NodePod,
    slot: &str,
) -> Option<(&'p str, Option<&'p ContainerState>, usize)> {
    if let Some((n, c)) = deliveries(pod, slot).last() {
        let state = pod
            .status
            .as_ref()
            .and_then(|s| s.ephemeral_container_statuses.as_ref())
            .and_then(|cs| cs.iter().find(|s| s.name == c.name))
            .and_then(|s| s.state.as_ref());
        return Some((c.image.as_deref()?, state, *n));
    }
    let init = pod
        .spec
        .as_ref()?
        .init_containers
        .as_ref()?
        .iter()
        .find(|c| c.name == slot)?;
    Some((init.image.as_deref()?, None, 0))
}

/// Why a delivery container will not copy, if it will not.
fn copy_failed(state: Option<&ContainerState>) -> Option<String> {
    let state = state?;
    if let Some(w) = &state.waiting
        && let Some(reason) = w.reason.as_deref().filter(|r| STUCK.contains(r))
    {
        return Some(format!(
            "the copy container cannot start: {reason}{}",
            w.message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ));
    }
    let t = state.terminated.as_ref()?;
    (t.exit_code != 0).then(|| {
        format!(
            "the copy exited with code {}{}",
            t.exit_code,
            t.message
                .as_deref()
                .map(|m| format!(": {}", m.trim()))
                .unwrap_or_default()
        )
    })
}

/// Whether a refusal the node reported `seconds_ago` (as of `now`) answers the copy whose
/// container is in `state`: a copy still running has not been answered yet, and one that
/// finished after the refusal (2 s of clock slack) is a later delivery of the same version (a
/// fixed image under the same version).
fn answers_this_copy(state: Option<&ContainerState>, seconds_ago: u64, now: Timestamp) -> bool {
    let Some(done) = state.and_then(|s| s.terminated.as_ref()) else {
        return false;
    };
    let Some(finished) = done.finished_at.as_ref().map(|t| t.0) else {
        return true;
    };
    let ago = SignedDuration::from_secs(i64::try_from(seconds_ago).unwrap_or(i64::MAX));
    let refused_at = now.checked_sub(ago).unwrap_or(now);
    refused_at
        >= finished
            .checked_sub(SignedDuration::from_secs(2))
            .unwrap_or(finished)
}

/// Whether a delivery container is still pulling or copying (neither finished nor stuck).
fn copy_running(state: Option<&ContainerState>) -> bool {
    state.is_none_or(|s| s.terminated.is_none()) && copy_failed(state).is_none()
}

/// Where `pod` stands with `plugin` at `image`, given its node's report as of `now`.
pub fn pod_state(
    pod: &NodePod,
    slot: &str,
    plugin: &EnginePlugin,
    report: Option<&NodeReport>,
    just_sent: bool,
    now: Timestamp,
) -> Option<PodState> {
    let (image, state, ordinal) = current(pod, slot)?;
    let from_init = ordinal == 0;
    if just_sent {
        // Sent moments ago, and the pod in the cache may not show it yet: whatever the cache
        // says about the copy (or an earlier one) is not this copy's outcome.
        return Some(PodState::InFlight);
    }
    let entry = report.and_then(|r| r.status.as_ref().ok()).and_then(|s| {
        s.plugins.iter().find(|p| {
            p.id == plugin.spec.engine_id
                && p.gpu_backend
                    .as_deref()
                    .is_none_or(|b| b == plugin.spec.gpu_backend.as_str())
        })
    });
    let version = plugin.spec.version.as_str();
    if image != plugin.spec.image {
        if !from_init && copy_running(state) {
            // A copy of another image is still on its way: two copies must never write one
            // directory at once, so the next waits for it.
            return Some(PodState::InFlight);
        }
        // Only a pod whose node serves gets a copy: a pod still starting runs its init
        // containers, and their older copy could land after the new one.
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        return Some(PodState::Stale {
            serving: running && entry.is_some_and(|p| p.loaded),
            ordinal,
        });
    }
    if from_init {
        // The template gave the pod this image: there is nothing to deliver to it.
        return Some(PodState::Done);
    }
    if let Some(why) = copy_failed(state) {
        return Some(PodState::Failed(why));
    }
    let copied = state
        .and_then(|s| s.terminated.as_ref())
        .is_some_and(|t| t.exit_code == 0);
    if !copied {
        return Some(PodState::InFlight);
    }
    let runs_it = entry.is_some_and(|p| p.loaded && p.version.as_deref() == Some(version));
    let last = entry.and_then(|p| p.update.as_ref());
    // The node's answer to this copy: an update of this version reported after it finished.
    let answer = last.filter(|u| {
        u.version.as_deref() == Some(version) && answers_this_copy(state, u.seconds_ago, now)
    });
    Some(match answer {
        Some(u) if u.state == "refused" || u.state == "restartRequired" => {
            PodState::Failed(format!("its node {}: {}", u.state, u.message))
        }
        Some(u) if u.state == "applied" && runs_it => PodState::Done,
        // No update recorded at all: the node started since and read the new files at start.
        None if last.is_none() && runs_it => PodState::Done,
        _ => PodState::InFlight,
    })
}

/// Decide one plugin's delivery: the pods to send the new image to now, and the progress.
/// `states` are the pods of the current template that mount the plugin, sorted by name.
pub fn plan(slot: &Slot<'_>, states: &[(String, PodState)]) -> (Vec<Delivery>, DeliveryProgress) {
    let mut progress = DeliveryProgress {
        plugin: slot.plugin.name_any(),
        version: slot.plugin.spec.version.clone(),
        pods: states.len(),
        ..DeliveryProgress::default()
    };
    let mut in_flight = 0;
    for (pod, s) in states {
        match s {
            PodState::Done => progress.done += 1,
            PodState::InFlight => in_flight += 1,
            PodState::Failed(why) if progress.halted.is_none() => {
                progress.halted = Some((pod.clone(), why.clone()));
            }
            PodState::Failed(_) | PodState::Stale { .. } => {}
        }
    }
    if progress.halted.is_some() {
        return (Vec::new(), progress);
    }
    // One pod proves the version; then a quarter of the pods at a time.
    let budget = if progress.done == 0 {
        1
    } else {
        states.len().div_ceil(4).max(1)
    };
    let mut room = budget.saturating_sub(in_flight);
    let mut sends = Vec::new();
    for (pod, s) in states {
        let PodState::Stale {
            serving: true,
            ordinal,
        } = s
        else {
            continue;
        };
        if room == 0 {
            break;
        }
        room -= 1;
        sends.push(Delivery {
            pod: pod.clone(),
            container: format!("{}-u{}", slot_prefix(&slot.container), ordinal + 1),
        });
    }
    (sends, progress)
}

/// The ephemeral container that copies `plugin` into a running pod.
pub fn copy_container(name: &str, plugin: &EnginePlugin) -> EphemeralContainer {
    EphemeralContainer {
        name: name.to_string(),
        image: Some(plugin.spec.image.clone()),
        image_pull_policy: Some("IfNotPresent".to_string()),
        command: Some(copy_command(plugin)),
        volume_mounts: Some(vec![engines_mount()]),
        security_context: Some(restricted_container_security()),
        termination_message_policy: Some("FallbackToLogsOnError".to_string()),
        ..EphemeralContainer::default()
    }
}

/// Why a delivery could not be written.
#[derive(Debug, thiserror::Error)]
pub enum DeliverError {
    #[error(
        "cannot add the plugin copy container {container} to node pod {pod}: {source}; \
         the pods keep the version they run (clusters that forbid ephemeral containers run the \
         operator with --plugin-delivery rollout)"
    )]
    Api {
        pod: String,
        container: String,
        #[source]
        source: kube::Error,
    },
}

impl DeliverError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            DeliverError::Api { source, .. } => match classify(source) {
                Retry::Permanent => "deliver_refused",
                Retry::Transient => "deliver_transient",
            },
        }
    }

    pub fn retry(&self) -> Retry {
        match self {
            DeliverError::Api { source, .. } => classify(source),
        }
    }
}

/// The recent-write key of a delivery to `pod` (the watch event of the patched pod may not
/// be in the cache when the next reconcile runs).
fn recent_kind(slot: &str) -> String {
    format!("Pod/deliver/{slot}")
}

/// Run the delivery of every slot over `pods` (the Model's node pods, sorted by name), for
/// pods of the current template, whose annotations are `template`.
pub async fn deliver<'a>(
    namespace: &str,
    slots: &[Slot<'a>],
    template: &BTreeMap<String, String>,
    pods: &[Arc<NodePod>],
    reports: &[NodeReport],
    ctx: &Context,
) -> Result<Vec<DeliveryProgress>, DeliverError> {
    let current_template = |p: &NodePod| {
        let a = p.annotations();
        TEMPLATE_KEYS
            .iter()
            .all(|k| template.get(*k).is_some() && a.get(*k) == template.get(*k))
    };
    let by_pod: BTreeMap<&str, &NodeReport> = reports.iter().map(|r| (r.pod.as_str(), r)).collect();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
    let mut out = Vec::new();
    for slot in slots {
        let kind = recent_kind(&slot.container);
        let states: Vec<(String, PodState)> = pods
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && current_template(p))
            .filter_map(|p| {
                let name = p.name_any();
                let sent =
                    ctx.caches
                        .recent
                        .holds(&kind, namespace, &name, &slot.plugin.spec.image);
                let report = by_pod.get(format!("{namespace}/{name}").as_str()).copied();
                pod_state(p, &slot.container, slot.plugin, report, sent, ctx.now())
                    .map(|s| (name, s))
            })
            .collect();
        let (sends, progress) = plan(slot, &states);
        for send in sends {
            let container = copy_container(&send.container, slot.plugin);
            match write::add_ephemeral_container(
                &api,
                &send.pod,
                &container,
                &ctx.metrics,
                CONTROLLER,
            )
            .await
            {
                Ok(_) => {}
                // Gone since the cache saw it (scaled down, evicted): nothing to deliver to.
                Err(e) if write::api_code(&e) == 404 => continue,
                Err(source) => {
                    return Err(DeliverError::Api {
                        pod: format!("{namespace}/{}", send.pod),
                        container: send.container.clone(),
                        source,
                    });
                }
            }
            ctx.caches
                .recent
                .wrote(&kind, namespace, &send.pod, &slot.plugin.spec.image);
            tracing::info!(pod = %send.pod, plugin = %progress.plugin, version = %progress.version, container = %send.container, "plugin delivered in place");
        }
        out.push(progress);
    }
    Ok(out)
}

/// The deliver step for the plugins `desired`'s pods take in place (none with
/// `--plugin-delivery rollout`).
pub(crate) async fn deliver_plugins(
    valid: &ValidModel,
    desired: &OwnedObjects,
    mounted: &[&EnginePlugin],
    observed: &Observed,
    ctx: &Context,
) -> Result<Vec<DeliveryProgress>, DeliverError> {
    if ctx.settings.plugin_delivery != PluginDelivery::InPlace {
        return Ok(Vec::new());
    }
    let slots: Vec<Slot<'_>> = in_place_slots(mounted)
        .into_iter()
        .map(|(container, plugin)| Slot { container, plugin })
        .collect();
    if slots.is_empty() {
        return Ok(Vec::new());
    }
    let annotations = desired
        .deployment
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default();
    let pods = ctx.caches.node_pods(&valid.namespace, &valid.name);
    deliver(
        &valid.namespace,
        &slots,
        &annotations,
        &pods,
        &observed.reports,
        ctx,
    )
    .await
}
