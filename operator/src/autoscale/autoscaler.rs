//! The built-in autoscaler (beside the reconcile path), one interval: for every target, read
//! its ready pods' load from the node report cache (`fetch`; a pod is asked when its answer is
//! older than one interval), decide with [`decide`](super::decide) (pure), write the
//! Deployment's `spec.replicas` when the count changes and `status.autoscaling` when the
//! decision does, both as `gantry-autoscaler`.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::node_pod::NodePod;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::{Client, ResourceExt};

use super::decide::{Decision, History, Observation, PodLoad, Policy, reason};
use super::fetch::{PodAnswer, fetch_loads};
use super::target::{
    Owner, POOL_KEY_PREFIX, Target, by_model, by_name, key, ready_pods, scale_up_requested_at,
};
use crate::context::Settings;
use crate::metrics::Metrics;
use crate::model::applied::controlled_by;
use crate::model::validate::validate;
use crate::node_report::{NodeStatusSource, PodFacts};
use crate::pool::admit;
use crate::report_cache::Reports;
use crate::write;
use gantry_crd::names::{AUTOSCALER_FIELD_MANAGER, owned_name};
use gantry_crd::{AutoscalingMode, AutoscalingStatus, Model, ModelPool};

/// Controller label of the autoscaler's writes in `gantry_operator_writes_total`.
pub const CONTROLLER: &str = "autoscaler";

/// Status documents fetched at once, across all Models, in one interval.
const CONCURRENT_FETCHES: usize = 32;

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

/// A ready pod to read, with the number of the answer read from it last time.
type ReadFrom = (PodFacts, u64);

/// A pod's answer with its number in the report cache.
type NumberedAnswer = (u64, PodAnswer);

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

/// The autoscaler: histories per Model plus the means to observe and write.
pub struct Autoscaler {
    client: Client,
    /// Asks a pod whose cached answer is too old (with the autoscaler's own timeout).
    node_status: Arc<dyn NodeStatusSource>,
    /// The node report cache the reconcilers read too.
    reports: Arc<Reports>,
    /// The oldest answer an interval uses: one interval.
    max_age: Duration,
    /// Per node pod (`namespace/name`), the number of the answer read last and when: an
    /// interval takes only a newer one. Pods not read for ten intervals are forgotten.
    last_read: HashMap<String, (u64, std::time::Instant)>,
    metrics: Arc<Metrics>,
    settings: Settings,
    /// Keyed by `namespace/name` (pools: `ModelPool/namespace/name`), with the uid: a
    /// re-created object starts afresh.
    histories: HashMap<String, (String, History)>,
    /// Per pool pod IP: when its pressure counter was last read, and its value.
    pressure: HashMap<String, (Timestamp, u64)>,
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
            reports: Arc::new(Reports::new(node_status.clone())),
            max_age: super::AutoscalerConfig::default().interval,
            last_read: HashMap::new(),
            node_status,
            metrics,
            settings,
            histories: HashMap::new(),
            pressure: HashMap::new(),
        }
    }

    /// Read answers from `reports` (shared with the reconcilers) and take one at most
    /// `max_age` old; a new autoscaler keeps a cache of its own and takes answers up to the
    /// default interval old.
    pub fn with_reports(mut self, reports: Arc<Reports>, max_age: Duration) -> Self {
        self.reports = reports;
        self.max_age = max_age;
        self
    }

    /// One interval over every Model: observe all (status fetches run concurrently), then
    /// decide and write Model by Model. A failed write is logged and counted; the other
    /// Models go on.
    pub async fn tick<M: Borrow<Model>, D: Borrow<Deployment>, P: Borrow<NodePod>>(
        &mut self,
        models: &[M],
        deployments: &[D],
        pods: &[P],
        now: Timestamp,
    ) -> Vec<Outcome> {
        let deployments = by_name(deployments);
        let pods = by_model(pods);
        let mut targets = Vec::new();
        let mut hpa = Vec::new();
        for model in models.iter().map(|m| -> &Model { m.borrow() }) {
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
            let ready = ready_pods(&pods, &valid);
            let served = Some(valid.served_name.clone());
            targets.push(Target {
                owner: Owner::Model(model),
                uid: valid.uid.clone(),
                policy: Policy::of(&valid),
                deployment,
                ready,
                served,
            });
        }
        let live: std::collections::HashSet<String> =
            models.iter().map(|m| key(m.borrow())).collect();
        self.histories
            .retain(|k, _| k.starts_with(POOL_KEY_PREFIX) || live.contains(k));
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
            outcomes.push(
                self.publish(Owner::Model(model), decision, false, now)
                    .await,
            );
        }
        outcomes.extend(self.observe_and_scale(targets, now).await);
        outcomes.sort_by(|a, b| a.model.cmp(&b.model));
        outcomes
    }

    /// One interval over every ModelPool with a Deployment, as [`Autoscaler::tick`] for
    /// Models: the load is every model's on each pod, plus the pods' memory pressure.
    pub async fn tick_pools<D: Borrow<Deployment>, P: Borrow<NodePod>>(
        &mut self,
        pools: &[ModelPool],
        deployments: &[D],
        pods: &[P],
        now: Timestamp,
    ) -> Vec<Outcome> {
        let deployments = by_name(deployments);
        let pods = by_model(pods);
        let mut targets = Vec::new();
        for pool in pools {
            if pool.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let Ok(valid) = admit::template(pool, &self.settings) else {
                continue;
            };
            let Some(deployment) = deployments
                .get(&(valid.namespace.clone(), owned_name(&valid.name)))
                .copied()
                .filter(|d| controlled_by(&d.metadata, &valid.uid))
            else {
                continue;
            };
            let ready = ready_pods(&pods, &valid);
            targets.push(Target {
                owner: Owner::Pool(pool),
                uid: valid.uid.clone(),
                policy: Policy::of(&valid),
                deployment,
                ready,
                served: None,
            });
        }
        let live: std::collections::HashSet<String> =
            pools.iter().map(|p| Owner::Pool(p).key()).collect();
        self.histories
            .retain(|k, _| !k.starts_with(POOL_KEY_PREFIX) || live.contains(k));
        let mut outcomes = self.observe_and_scale(targets, now).await;
        outcomes.sort_by(|a, b| a.model.cmp(&b.model));
        outcomes
    }

    /// Read every target's ready pods' load (asking, concurrently, those whose answer is too
    /// old), then decide and write target by target.
    async fn observe_and_scale(
        &mut self,
        targets: Vec<Target<'_>>,
        now: Timestamp,
    ) -> Vec<Outcome> {
        // The reads own what they need (no borrow crosses the concurrent stream), and come
        // back keyed by the target's index.
        let (source, reports, max_age) =
            (self.node_status.clone(), self.reports.clone(), self.max_age);
        let read = &self.last_read;
        let asks: Vec<(usize, Option<String>, Vec<ReadFrom>)> = targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let pods = t
                    .ready
                    .iter()
                    .map(|f| (f.clone(), read.get(&f.pod).map_or(0, |r| r.0)))
                    .collect();
                (i, t.served.clone(), pods)
            })
            .collect();
        let mut answers: Vec<(usize, Vec<Option<NumberedAnswer>>)> =
            futures::stream::iter(asks.into_iter().map(|(i, served, pods)| {
                let (source, reports) = (source.clone(), reports.clone());
                async move { (i, fetch_loads(reports, source, served, pods, max_age).await) }
            }))
            .buffer_unordered(CONCURRENT_FETCHES)
            .collect()
            .await;
        answers.sort_by_key(|(i, _)| *i);
        // Remember which answer each ready pod gave; forget pods long gone.
        let now_instant = std::time::Instant::now();
        let forget_after = self.max_age * 10;
        self.last_read
            .retain(|_, (_, at)| now_instant.duration_since(*at) < forget_after);
        let last_read = &mut self.last_read;
        let answers: Vec<(usize, Vec<Option<PodAnswer>>)> = answers
            .into_iter()
            .map(|(i, pods)| {
                let answers = pods
                    .into_iter()
                    .zip(&targets[i].ready)
                    .map(|(a, f)| {
                        a.map(|(seq, answer)| {
                            last_read.insert(f.pod.clone(), (seq, now_instant));
                            answer
                        })
                    })
                    .collect();
                (i, answers)
            })
            .collect();
        let mut outcomes = Vec::new();
        for (t, (_, answers)) in targets.into_iter().zip(answers) {
            let pressure = match t.owner {
                Owner::Pool(_) => self.pressure_per_minute(&t.ready, &answers, now),
                Owner::Model(_) => 0.0,
            };
            let loads = answers.into_iter().map(|a| a.map(|a| a.load)).collect();
            outcomes.push(self.scale(&t, loads, pressure, now).await);
        }
        outcomes
    }

    /// Evictions plus refused loads per minute, summed over `ips` that answered, since each
    /// pod's previous reading (a pod read for the first time, or whose counter went back
    /// because it restarted, counts nothing this interval).
    fn pressure_per_minute(
        &mut self,
        pods: &[PodFacts],
        answers: &[Option<PodAnswer>],
        now: Timestamp,
    ) -> f64 {
        let mut rate = 0.0;
        for (pod, answer) in pods.iter().zip(answers) {
            let Some(answer) = answer else { continue };
            if let Some((then, before)) = self.pressure.get(&pod.ip)
                && answer.pressure_total >= *before
            {
                let minutes = (now.as_millisecond() - then.as_millisecond()) as f64 / 60_000.0;
                if minutes > 0.0 {
                    rate += (answer.pressure_total - before) as f64 / minutes;
                }
            }
            self.pressure
                .insert(pod.ip.clone(), (now, answer.pressure_total));
        }
        rate
    }

    /// Decide and write for one Builtin-mode Model.
    async fn scale(
        &mut self,
        t: &Target<'_>,
        loads: Vec<Option<PodLoad>>,
        memory_pressure: f64,
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
            memory_pressure,
        };
        let stored = t.owner.stored();
        let entry = self
            .histories
            .entry(t.owner.key())
            .or_insert_with(|| (t.uid.clone(), resume(stored, current)));
        if entry.0 != t.uid {
            *entry = (t.uid.clone(), resume(stored, current));
        }
        let decision = entry.1.decide(&t.policy, &obs);
        let mut scaled = false;
        if decision.desired != current {
            let ns = t.deployment.namespace().unwrap_or_default();
            let name = t.deployment.name_any();
            let api = Api::<Deployment>::namespaced(self.client.clone(), &ns);
            match write::apply_replicas(&api, &name, decision.desired, &self.metrics, CONTROLLER)
                .await
            {
                Ok(_) => {
                    scaled = true;
                    tracing::info!(target = %t.owner.key(), from = current, to = decision.desired,
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
                        model: t.owner.key(),
                        decision,
                        scaled: false,
                        status_written: false,
                    };
                }
            }
        }
        self.publish(t.owner, decision, scaled, now).await
    }

    /// Apply `body` to the status of the `K` named `name` in `ns`, as the autoscaler.
    async fn apply_autoscaling<K>(
        &self,
        ns: &str,
        name: &str,
        body: &serde_json::Value,
    ) -> Result<(), kube::Error>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + std::fmt::Debug
            + serde::de::DeserializeOwned,
    {
        let api = Api::<K>::namespaced(self.client.clone(), ns);
        write::apply_status_as(
            &api,
            name,
            body,
            AUTOSCALER_FIELD_MANAGER,
            &self.metrics,
            CONTROLLER,
        )
        .await
        .map(drop)
    }

    /// Write `status.autoscaling` when the mode, reason or count differs from the stored one.
    async fn publish(
        &self,
        owner: Owner<'_>,
        decision: Decision,
        scaled: bool,
        now: Timestamp,
    ) -> Outcome {
        let stored = owner.stored();
        let mode = owner.mode();
        let unchanged = stored.is_some_and(|s| {
            s.mode == mode && s.reason == decision.reason && s.desired_replicas == decision.desired
        });
        let mut outcome = Outcome {
            model: owner.key(),
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
        let (ns, name) = (owner.namespace(), owner.name());
        let body = serde_json::json!({ "autoscaling": status });
        let written = match owner {
            Owner::Model(_) => self.apply_autoscaling::<Model>(&ns, &name, &body).await,
            Owner::Pool(_) => self.apply_autoscaling::<ModelPool>(&ns, &name, &body).await,
        };
        match written {
            Ok(()) => outcome.status_written = true,
            Err(source) => {
                let e = ScaleError::Status { ns, name, source };
                self.metrics.reconcile_failed(CONTROLLER, e.metric_label());
                tracing::warn!(error = %e, "autoscaler");
            }
        }
        outcome
    }
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
