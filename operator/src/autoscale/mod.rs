//! The built-in autoscaler (beside the reconcile path, on the leader only): every interval it
//! reads each Builtin-mode Model's ready node pods (`GET /v1/status`: waiting, running, KV
//! use), decides a replica count ([`decide`], pure) and writes only two things, both under the
//! field manager `gantry-autoscaler`: the node Deployment's `spec.replicas` and the Model's
//! `status.autoscaling`.
//!
//! Guarantees: the user's spec is never written; HPA-mode Models are left to their
//! HorizontalPodAutoscaler (only `status.autoscaling` says so, once); the status is written
//! only when the decision's reason or count changes, so a steady load writes nothing; a node
//! pod that does not answer holds the count (never a scale-down on missing data). Assumption:
//! the reconciler's apply leaves `spec.replicas` out after creation (`model::apply`), so the
//! two never fight over it. docs/autoscaling.md describes the algorithm.

pub mod decide;

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use kube::runtime::reflector::store::WriterDropped;
use kube::{Client, ResourceExt};

use crate::cache::Caches;
use crate::context::Settings;
use crate::metrics::Metrics;
use crate::model::apply::controlled_by;
use crate::model::validate::{ValidModel, validate};
use crate::node_report::{HttpNodeStatus, ModelRef, NodeStatusSource, reachable};
use crate::write;
use decide::{Decision, History, Observation, PodLoad, Policy, reason};
use gantry_crd::names::{
    ANNOTATION_SCALE_UP_REQUESTED, AUTOSCALER_FIELD_MANAGER, LABEL_MODEL, LABEL_NAME,
    NODE_APP_NAME, owned_name,
};
use gantry_crd::{AutoscalingMode, AutoscalingStatus, Model};

/// Controller label of the autoscaler's writes in `gantry_operator_writes_total`.
pub const CONTROLLER: &str = "autoscaler";

/// Status documents fetched at once, across all Models, in one interval.
const CONCURRENT_FETCHES: usize = 32;

/// The autoscaler's command-line flags (flattened into `gantry-operator run`).
#[derive(Clone, Debug, clap::Args)]
pub struct AutoscalerArgs {
    /// Run the built-in autoscaler on the leader (`false`: Builtin-mode Deployments keep the
    /// count they were created with, or whatever `kubectl scale` sets).
    #[arg(long = "autoscaler", env = "GANTRY_AUTOSCALER", default_value_t = true, action = clap::ArgAction::Set)]
    pub autoscaler: bool,
    /// Seconds between two autoscaler decisions.
    #[arg(long, env = "GANTRY_AUTOSCALER_INTERVAL_SECONDS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=300))]
    pub autoscaler_interval_seconds: u64,
    /// Milliseconds to wait for one node pod's status before counting it as silent.
    #[arg(long, env = "GANTRY_AUTOSCALER_METRICS_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=30000))]
    pub autoscaler_metrics_timeout_ms: u64,
}

impl AutoscalerArgs {
    /// `None` when the autoscaler is switched off.
    pub fn config(&self) -> Option<AutoscalerConfig> {
        self.autoscaler.then(|| AutoscalerConfig {
            interval: Duration::from_secs(self.autoscaler_interval_seconds),
            metrics_timeout: Duration::from_millis(self.autoscaler_metrics_timeout_ms),
        })
    }
}

/// How the autoscaler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutoscalerConfig {
    pub interval: Duration,
    /// Per node pod status request.
    pub metrics_timeout: Duration,
}

impl Default for AutoscalerConfig {
    fn default() -> Self {
        AutoscalerConfig {
            interval: Duration::from_secs(5),
            metrics_timeout: Duration::from_secs(1),
        }
    }
}

/// Why one Model's interval failed (the others go on; the Model is tried again next interval).
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    #[error("cannot scale Deployment {ns}/{name} to {replicas}: {source}")]
    Scale {
        ns: String,
        name: String,
        replicas: i32,
        #[source]
        source: kube::Error,
    },
    #[error("cannot write status.autoscaling of Model {ns}/{name}: {source}")]
    Status {
        ns: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl ScaleError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ScaleError::Scale { .. } => "autoscaler_scale",
            ScaleError::Status { .. } => "autoscaler_status",
        }
    }
}

/// What one interval did for one Model (for logs and tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// `namespace/name` of the Model.
    pub model: String,
    pub decision: Decision,
    /// The Deployment's replicas were written.
    pub scaled: bool,
    /// `status.autoscaling` was written.
    pub status_written: bool,
}

/// One Model to look at this interval.
struct Target<'a> {
    model: &'a Model,
    valid: ValidModel,
    deployment: &'a Deployment,
    /// Ready node pods of the Model, with their IPs.
    ready: Vec<&'a str>,
}

/// The autoscaler: histories per Model plus the means to observe and write.
pub struct Autoscaler {
    client: Client,
    node_status: Arc<dyn NodeStatusSource>,
    metrics: Arc<Metrics>,
    settings: Settings,
    /// Keyed by `namespace/name`, with the Model's uid: a re-created Model starts afresh.
    histories: HashMap<String, (String, History)>,
}

fn key(model: &Model) -> String {
    format!(
        "{}/{}",
        model.namespace().unwrap_or_default(),
        model.name_any()
    )
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The gateway's scale-up request, if present and a valid RFC 3339 time.
pub fn scale_up_requested_at(deployment: &Deployment) -> Option<Timestamp> {
    let raw = deployment
        .metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_SCALE_UP_REQUESTED)?;
    match Timestamp::from_str(raw) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(deployment = %deployment.name_any(), value = %raw, error = %e,
                "ignoring {ANNOTATION_SCALE_UP_REQUESTED}: not an RFC 3339 time");
            None
        }
    }
}

impl Autoscaler {
    pub fn new(
        client: Client,
        node_status: Arc<dyn NodeStatusSource>,
        metrics: Arc<Metrics>,
        settings: Settings,
    ) -> Self {
        Autoscaler {
            client,
            node_status,
            metrics,
            settings,
            histories: HashMap::new(),
        }
    }

    /// One interval over every Model: observe all (status fetches run concurrently), then
    /// decide and write Model by Model. A failed write is logged and counted; the other
    /// Models go on.
    pub async fn tick<D: Borrow<Deployment>, P: Borrow<Pod>>(
        &mut self,
        models: &[Model],
        deployments: &[D],
        pods: &[P],
        now: Timestamp,
    ) -> Vec<Outcome> {
        let deployments: BTreeMap<(String, String), &Deployment> = deployments
            .iter()
            .map(|d| {
                let d: &Deployment = d.borrow();
                ((d.namespace().unwrap_or_default(), d.name_any()), d)
            })
            .collect();
        let mut targets = Vec::new();
        let mut hpa = Vec::new();
        for model in models {
            if model.metadata.deletion_timestamp.is_some() {
                continue;
            }
            // An invalid spec is the reconciler's to report; the autoscaler waits for a fix.
            let Ok(valid) = validate(model, &self.settings) else {
                continue;
            };
            let ns = valid.namespace.clone();
            let Some(deployment) = deployments
                .get(&(ns.clone(), owned_name(&valid.name)))
                .copied()
                .filter(|d| controlled_by(&d.metadata, &valid.uid))
            else {
                continue;
            };
            if valid.autoscaling.mode == AutoscalingMode::Hpa {
                hpa.push((model, deployment));
                continue;
            }
            let ready = pods
                .iter()
                .map(|p| -> &Pod { p.borrow() })
                .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
                .filter(|p| {
                    p.labels().get(LABEL_MODEL) == Some(&valid.name)
                        && p.labels().get(LABEL_NAME).map(String::as_str) == Some(NODE_APP_NAME)
                })
                .filter(|p| is_ready(p))
                .filter_map(reachable)
                .collect();
            targets.push(Target {
                model,
                valid,
                deployment,
                ready,
            });
        }
        let live: std::collections::HashSet<String> = models.iter().map(key).collect();
        self.histories.retain(|k, _| live.contains(k));

        // The fetches own what they need (no borrow crosses the concurrent stream), and come
        // back keyed by the target's index.
        let source = self.node_status.clone();
        type Ask = (usize, (String, String), String, Vec<String>);
        let asks: Vec<Ask> = targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let ips = t.ready.iter().map(|ip| (*ip).to_string()).collect();
                let model = (t.valid.namespace.clone(), t.valid.name.clone());
                (i, model, t.valid.served_name.clone(), ips)
            })
            .collect();
        let mut answers: Vec<(usize, Vec<Option<PodLoad>>)> =
            futures::stream::iter(asks.into_iter().map(|(i, model, served, ips)| {
                let source = source.clone();
                async move { (i, fetch_loads(source, model, served, ips).await) }
            }))
            .buffer_unordered(CONCURRENT_FETCHES)
            .collect()
            .await;
        answers.sort_by_key(|(i, _)| *i);
        let observed = targets
            .into_iter()
            .zip(answers.into_iter().map(|(_, loads)| loads));

        let mut outcomes = Vec::new();
        for (model, deployment) in hpa {
            let decision = Decision {
                desired: deployment.spec.replicas.unwrap_or(1),
                reason: reason::DELEGATED_TO_HPA,
                message: format!(
                    "autoscaling.mode is HPA: HorizontalPodAutoscaler {} sets the replicas",
                    owned_name(&model.name_any())
                ),
            };
            self.histories.remove(&key(model));
            outcomes.push(self.publish(model, decision, false, now).await);
        }
        for (t, loads) in observed {
            outcomes.push(self.scale(&t, loads, now).await);
        }
        outcomes.sort_by(|a, b| a.model.cmp(&b.model));
        outcomes
    }

    /// Decide and write for one Builtin-mode Model.
    async fn scale(
        &mut self,
        t: &Target<'_>,
        loads: Vec<Option<PodLoad>>,
        now: Timestamp,
    ) -> Outcome {
        let current = t.deployment.spec.replicas.unwrap_or(1);
        let silent = loads.iter().filter(|l| l.is_none()).count();
        let obs = Observation {
            now,
            current,
            ready: i32::try_from(t.ready.len()).unwrap_or(i32::MAX),
            loads: loads.into_iter().flatten().collect(),
            silent,
            scale_up_requested_at: scale_up_requested_at(t.deployment),
        };
        let stored = t.model.status.as_ref().and_then(|s| s.autoscaling.as_ref());
        let entry = self
            .histories
            .entry(key(t.model))
            .or_insert_with(|| (t.valid.uid.clone(), resume(stored, current)));
        if entry.0 != t.valid.uid {
            *entry = (t.valid.uid.clone(), resume(stored, current));
        }
        let decision = entry.1.decide(&Policy::of(&t.valid), &obs);
        let mut scaled = false;
        if decision.desired != current {
            let ns = t.valid.namespace.clone();
            let name = t.deployment.name_any();
            let api = Api::<Deployment>::namespaced(self.client.clone(), &ns);
            match write::apply_replicas(&api, &name, decision.desired, &self.metrics, CONTROLLER)
                .await
            {
                Ok(_) => {
                    scaled = true;
                    tracing::info!(model = %key(t.model), from = current, to = decision.desired,
                        reason = decision.reason, message = %decision.message, "scaled");
                }
                Err(source) => {
                    let e = ScaleError::Scale {
                        ns,
                        name,
                        replicas: decision.desired,
                        source,
                    };
                    self.metrics.reconcile_failed(CONTROLLER, e.metric_label());
                    tracing::warn!(error = %e, "autoscaler");
                    return Outcome {
                        model: key(t.model),
                        decision,
                        scaled: false,
                        status_written: false,
                    };
                }
            }
        }
        self.publish(t.model, decision, scaled, now).await
    }

    /// Write `status.autoscaling` when the mode, reason or count differs from the stored one.
    async fn publish(
        &self,
        model: &Model,
        decision: Decision,
        scaled: bool,
        now: Timestamp,
    ) -> Outcome {
        let stored = model.status.as_ref().and_then(|s| s.autoscaling.as_ref());
        let mode = model
            .spec
            .autoscaling
            .as_ref()
            .map(|a| a.mode)
            .unwrap_or_default()
            .as_str();
        let unchanged = stored.is_some_and(|s| {
            s.mode == mode && s.reason == decision.reason && s.desired_replicas == decision.desired
        });
        let mut outcome = Outcome {
            model: key(model),
            decision,
            scaled,
            status_written: false,
        };
        if unchanged && !scaled {
            return outcome;
        }
        let status = AutoscalingStatus {
            mode: mode.to_string(),
            desired_replicas: outcome.decision.desired,
            reason: outcome.decision.reason.to_string(),
            message: outcome.decision.message.clone(),
            last_decision_time: Some(Time(now)),
            last_scale_time: if scaled {
                Some(Time(now))
            } else {
                stored.and_then(|s| s.last_scale_time.clone())
            },
        };
        let ns = model.namespace().unwrap_or_default();
        let api = Api::<Model>::namespaced(self.client.clone(), &ns);
        let body = serde_json::json!({ "autoscaling": status });
        match write::apply_status_as(
            &api,
            &model.name_any(),
            &body,
            AUTOSCALER_FIELD_MANAGER,
            &self.metrics,
            CONTROLLER,
        )
        .await
        {
            Ok(_) => outcome.status_written = true,
            Err(source) => {
                let e = ScaleError::Status {
                    ns,
                    name: model.name_any(),
                    source,
                };
                self.metrics.reconcile_failed(CONTROLLER, e.metric_label());
                tracing::warn!(error = %e, "autoscaler");
            }
        }
        outcome
    }
}

/// Ask every ready pod of one Model for its load; `None` for a pod that stays silent.
async fn fetch_loads(
    source: Arc<dyn NodeStatusSource>,
    model: (String, String),
    served: String,
    ips: Vec<String>,
) -> Vec<Option<PodLoad>> {
    let (namespace, name) = (model.0.as_str(), model.1.as_str());
    futures::future::join_all(ips.iter().map(|ip| {
        let source = source.clone();
        let served = served.as_str();
        async move {
            let status = source.fetch(ip, ModelRef { namespace, name }).await.ok()?;
            let entry = status.models.iter().find(|m| m.id == served)?;
            Some(PodLoad::from_queue(&entry.queue))
        }
    }))
    .await
}

/// A history for a Model seen for the first time (start-up or leader change): a Model at zero
/// that the autoscaler scaled there keeps that time, so an older gateway request stays old.
fn resume(stored: Option<&AutoscalingStatus>, current: i32) -> History {
    let zero_since = stored
        .filter(|s| current == 0 && s.reason == reason::SCALED_TO_ZERO_IDLE)
        .and_then(|s| s.last_scale_time.as_ref())
        .map(|t| t.0);
    History::resume(zero_since)
}

/// Why the autoscaler stopped (it otherwise runs until aborted).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot build the autoscaler's node status client")]
    NodeStatusClient(#[source] reqwest::Error),
    #[error("{watch} watch ended")]
    WatchEnded {
        watch: &'static str,
        #[source]
        source: WriterDropped,
    },
}

/// Runs [`Autoscaler::tick`] every interval over the controller's caches (Models, the
/// operator's Deployments and node pods: the autoscaler keeps no copies of its own) until the
/// task is aborted (the controller does so when it stops leading).
pub async fn run(
    client: Client,
    config: AutoscalerConfig,
    settings: Settings,
    metrics: Arc<Metrics>,
    models: Store<DeserializeGuard<Model>>,
    caches: Caches,
) -> Result<(), RunError> {
    let node_status = HttpNodeStatus::with_timeout(settings.node_port, config.metrics_timeout)
        .map_err(RunError::NodeStatusClient)?
        .with_install_token(settings.node_token.clone());
    let ended =
        |watch: &'static str| move |source: WriterDropped| RunError::WatchEnded { watch, source };
    models.wait_until_ready().await.map_err(ended("Model"))?;
    caches
        .wait_until_ready()
        .await
        .map_err(ended("owned objects"))?;
    tracing::info!(interval_s = config.interval.as_secs(), "autoscaler running");
    let mut autoscaler = Autoscaler::new(client, Arc::new(node_status), metrics, settings);
    let mut ticks = tokio::time::interval(config.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let models = snapshot_models(&models);
        let deployments = caches.deployments.state();
        let pods = caches.pods.state();
        autoscaler
            .tick(&models, &deployments, &pods, Timestamp::now())
            .await;
    }
}

/// Models that deserialized (a malformed one is the reconciler's to report).
fn snapshot_models(store: &Store<DeserializeGuard<Model>>) -> Vec<Model> {
    store
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok().cloned())
        .collect()
}
