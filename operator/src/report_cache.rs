//! Node report cache (read step of both reconcilers): the last `GET /v1/status` answer of every
//! node pod, refreshed on its own schedule by [`poll`] and folded into status by a reconcile
//! only when what the status is made of changed.
//!
//! Cost model: a reconcile reads reports from here and asks a pod itself only when it has
//! never been asked (it just started) or its IP changed. The poller asks each reachable node
//! pod once per interval — 10 s while its Model is converging, 60 s once it is settled (Ready,
//! not Progressing, no recent engine crash) — with each pod's due time spread by ±20 % from
//! its uid, at most 64 requests in flight and a 2 s timeout each. The autoscaler reads the
//! same entries ([`Reports::recent`]) and asks a ready pod itself only when its entry is older
//! than one autoscaler interval, so a pod is asked once per interval whoever needs the answer,
//! and the poller finds the pods the autoscaler reads always fresh. A pod whose answer differs
//! in anything the status shows (queue figures, download speed and the running seconds of a
//! crash or a plugin update are left out) triggers a reconcile of its Model and of the
//! EnginePlugins it mounts, whoever asked; an unchanged answer triggers nothing.
//!
//! A pod that answered before and then fails to answer keeps its last answer for
//! [`FAILURES_KEPT`] failed asks in a row, asked again after [`RETRY_AFTER`] each time: a
//! status request that times out once under load must not flip its Model's conditions (and
//! write its status and an Event twice). The next failure is stored and shown.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::node_pod::NodePod;
use futures::channel::mpsc;
use futures::{SinkExt, StreamExt};
use gantry_api::NodeStatus;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::node_report::{self, NodeReport, NodeStatusSource, PodFacts, ReportError};
use crate::watch_cache::ModelRef;
use gantry_crd::conditions::{FALSE, TRUE, find, model as cond};
use gantry_crd::{EnginePlugin, Model};

/// A reconcile request for one EnginePlugin.
pub type PluginRef = ObjectRef<DeserializeGuard<EnginePlugin>>;

/// Failed asks in a row of a pod that answered before that keep its last answer.
pub const FAILURES_KEPT: u32 = 2;

/// How soon a pod whose last ask failed, and whose previous answer is kept, is asked again.
pub const RETRY_AFTER: Duration = Duration::from_secs(2);

/// One pod's last answer.
#[derive(Clone, Debug)]
struct Entry {
    uid: String,
    ip: String,
    /// When the pod was last asked (whether it answered or not).
    fetched: Instant,
    status: Result<NodeStatus, ReportError>,
    fingerprint: u64,
    /// Failed asks since the last answer (a kept answer while `status` is `Ok`).
    failures: u32,
    /// Which answer this is, in the order answers came in (a kept answer keeps its number):
    /// a reader that remembers the number never takes the same answer for a new one.
    seq: u64,
}

impl Entry {
    /// Whether this answer came from the pod `f` describes (same pod uid, same IP).
    fn is_for(&self, f: &PodFacts) -> bool {
        self.uid == f.uid && self.ip == f.ip
    }
}

/// The last answer of every node pod, by `namespace/name`.
pub struct Reports {
    source: Arc<dyn NodeStatusSource>,
    entries: Mutex<HashMap<String, Entry>>,
    /// Pods whose answer changed when someone other than the poller asked (the autoscaler):
    /// the poller's next pass triggers their reconciles.
    noticed: Mutex<Vec<PodFacts>>,
    /// The number of the last answer stored.
    seq: std::sync::atomic::AtomicU64,
}

/// What of an answer the status is made of: everything but the queue figures and the
/// download speed, which change with every request and are the autoscaler's to read, and the
/// seconds that count up on every poll: of a crash record only whether it is recent
/// (`node_report::crash_is_recent`), of a plugin update not its age at all.
pub fn fingerprint(status: &Result<NodeStatus, ReportError>) -> u64 {
    let mut h = DefaultHasher::new();
    match status {
        Ok(s) => {
            let mut s = s.clone();
            for p in &mut s.plugins {
                if let Some(u) = &mut p.update {
                    u.seconds_ago = 0;
                }
            }
            for m in &mut s.models {
                m.queue = Default::default();
                m.artifact.bytes_per_second = 0.0;
                if let Some(c) = &mut m.crashes {
                    let recent = node_report::crash_is_recent(c);
                    c.seconds_ago = if recent {
                        0
                    } else {
                        node_report::CRASH_QUIET_SECONDS
                    };
                    c.restart_in_seconds = u64::from(c.restart_in_seconds > 0);
                }
            }
            serde_json::to_string(&s).unwrap_or_default().hash(&mut h);
        }
        Err(e) => e.to_string().hash(&mut h),
    }
    h.finish()
}

impl Reports {
    pub fn new(source: Arc<dyn NodeStatusSource>) -> Self {
        Reports {
            source,
            entries: Mutex::new(HashMap::new()),
            noticed: Mutex::new(Vec::new()),
            seq: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The cached answer of a pod, if it is for this pod (uid) at this IP.
    fn cached(&self, f: &PodFacts) -> Option<Result<NodeStatus, ReportError>> {
        self.lock()
            .get(&f.pod)
            .filter(|e| e.is_for(f))
            .map(|e| e.status.clone())
    }

    /// Ask the pod now (through `source`) and store the answer; true when what is stored
    /// changed its fingerprint. The answer itself is returned as it came (a failure too, when
    /// the previous answer is kept).
    async fn refresh(
        &self,
        source: &dyn NodeStatusSource,
        f: &PodFacts,
    ) -> (bool, Result<NodeStatus, ReportError>) {
        let status = node_report::fetch(source, f).await;
        let mut entries = self.lock();
        let old = entries.get_mut(&f.pod).filter(|e| e.is_for(f));
        let failures = match (&status, old) {
            (Ok(_), _) | (Err(_), None) => 0,
            (Err(_), Some(old)) if old.status.is_ok() && old.failures < FAILURES_KEPT => {
                old.failures += 1;
                old.fetched = Instant::now();
                return (false, status);
            }
            (Err(_), Some(old)) => old.failures + 1,
        };
        let fp = fingerprint(&status);
        let entry = Entry {
            uid: f.uid.clone(),
            ip: f.ip.clone(),
            fetched: Instant::now(),
            status: status.clone(),
            fingerprint: fp,
            failures,
            seq: self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
        };
        let old = entries.insert(f.pod.clone(), entry);
        let changed = old.is_none_or(|o| o.fingerprint != fp || o.uid != f.uid);
        (changed, status)
    }

    /// What `read` takes of a ready pod's answer, for the autoscaler, with the answer's
    /// number: of the stored one when the pod answered less than `max_age` ago and the answer
    /// is newer than the reader's last (`after`, its number), else the pod is asked now
    /// through `source` (a change is noticed for the poller to trigger). A pod that fails to
    /// answer gives its kept answer (see [`FAILURES_KEPT`]); `None`: it has none. `read` runs
    /// under the cache's lock, so nothing of the answer is copied but what it takes.
    pub async fn recent<R>(
        &self,
        source: &dyn NodeStatusSource,
        f: &PodFacts,
        max_age: Duration,
        after: u64,
        read: impl FnOnce(&NodeStatus) -> R,
    ) -> Option<(u64, R)> {
        let fresh = self.lock().get(&f.pod).is_some_and(|e| {
            e.is_for(f) && e.fetched.elapsed() < max_age && e.failures == 0 && e.seq > after
        });
        if !fresh {
            let (changed, _) = self.refresh(source, f).await;
            if changed {
                self.noticed
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(f.clone());
            }
        }
        let entries = self.lock();
        let e = entries.get(&f.pod).filter(|e| e.is_for(f))?;
        e.status.as_ref().ok().map(|s| (e.seq, read(s)))
    }

    /// The pods whose answer changed outside the poller since the last call.
    fn take_noticed(&self) -> Vec<PodFacts> {
        std::mem::take(
            &mut *self
                .noticed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The reports of `pods` (those that can answer), sorted by pod name: cached answers as
    /// they are, pods never asked (or at a new IP) asked now, concurrently.
    pub async fn of(&self, pods: &[Arc<NodePod>]) -> Vec<NodeReport> {
        let asks = pods
            .iter()
            .filter_map(|p| node_report::facts(p))
            .map(|f| async move {
                let status = match self.cached(&f) {
                    Some(status) => status,
                    None => self.refresh(self.source.as_ref(), &f).await.1,
                };
                NodeReport {
                    pod: f.pod,
                    config_hash: f.config_hash,
                    plugins: f.plugins,
                    status,
                }
            });
        let mut reports = futures::future::join_all(asks).await;
        reports.sort_by(|a, b| a.pod.cmp(&b.pod));
        reports
    }

    /// Forget pods that are gone.
    fn retain(&self, live: &HashSet<String>) {
        self.lock().retain(|k, _| live.contains(k));
    }

    /// Answers held and their serialized JSON size (the `gantry_operator_cache_*` gauges).
    pub fn footprint(&self) -> (usize, usize) {
        let entries = self.lock();
        let answers = crate::watch_cache::serialized_size(
            entries.values().filter_map(|e| e.status.as_ref().ok()),
        );
        let failures: usize = entries
            .values()
            .filter_map(|e| e.status.as_ref().err())
            .map(|e| e.to_string().len())
            .sum();
        (entries.len(), answers + failures)
    }

    /// Pods in the cache.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How the poller runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollConfig {
    /// Between two answers of a pod whose Model is still converging.
    pub converging: Duration,
    /// Between two answers of a pod whose Model is settled.
    pub settled: Duration,
    /// Requests in flight at once, across all pods.
    pub concurrency: usize,
}

impl Default for PollConfig {
    fn default() -> Self {
        PollConfig {
            converging: Duration::from_secs(10),
            settled: Duration::from_secs(60),
            concurrency: 64,
        }
    }
}

/// A factor in [0.8, 1.2) from a stable key: spreads pods started together over the interval.
pub fn jitter(key: &str) -> f64 {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    0.8 + (h.finish() % 4000) as f64 / 10_000.0
}

/// A factor in [1.0, 1.2) from a stable key: stretches a safety-net resync so objects created
/// together do not resync together.
pub fn stretch(key: &str) -> f64 {
    1.0 + (jitter(key) - 0.8) / 2.0
}

/// Settled: Ready, not Progressing, and no recent engine crash (whose end a 10 s poll sees
/// sooner).
fn settled(model: &Model) -> bool {
    model.status.as_ref().is_some_and(|s| {
        find(&s.conditions, cond::READY).is_some_and(|c| c.status == TRUE)
            && find(&s.conditions, cond::PROGRESSING).is_some_and(|c| c.status == FALSE)
            && find(&s.conditions, cond::ENGINE_HEALTHY).is_none_or(|c| c.status != FALSE)
    })
}

/// The pods due for a new answer now, with the interval of each.
fn due(
    reports: &Reports,
    pods: &[Arc<NodePod>],
    settled_models: &HashSet<(String, String)>,
    config: &PollConfig,
) -> Vec<PodFacts> {
    let entries = reports.lock();
    pods.iter()
        .filter_map(|p| node_report::facts(p))
        .filter(|f| {
            let interval = if entries
                .get(&f.pod)
                .is_some_and(|e| e.failures > 0 && e.status.is_ok())
            {
                RETRY_AFTER
            } else if settled_models.contains(&(f.namespace.clone(), f.model.clone())) {
                config.settled
            } else {
                config.converging
            };
            match entries.get(&f.pod) {
                Some(e) if e.is_for(f) => e.fetched.elapsed() >= interval.mul_f64(jitter(&f.uid)),
                _ => true,
            }
        })
        .collect()
}

/// Refresh the reports of every node pod on its schedule until the triggers' receivers are
/// gone (the controllers stopped). One pass per second looks for pods that are due.
pub async fn poll(
    reports: Arc<Reports>,
    pods: Store<NodePod>,
    models: Store<DeserializeGuard<Model>>,
    config: PollConfig,
    mut model_trigger: mpsc::Sender<ModelRef>,
    mut plugin_trigger: mpsc::Sender<PluginRef>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let all = pods.state();
        let live: HashSet<String> = all
            .iter()
            .map(|p| {
                format!(
                    "{}/{}",
                    p.metadata.namespace.as_deref().unwrap_or_default(),
                    p.metadata.name.as_deref().unwrap_or_default()
                )
            })
            .collect();
        reports.retain(&live);
        let settled_models: HashSet<(String, String)> = models
            .state()
            .iter()
            .filter_map(|g| g.0.as_ref().ok())
            .filter(|m| settled(m))
            .map(|m| {
                (
                    m.metadata.namespace.clone().unwrap_or_default(),
                    m.metadata.name.clone().unwrap_or_default(),
                )
            })
            .collect();
        let due = due(&reports, &all, &settled_models, &config);
        let mut changed: Vec<PodFacts> = futures::stream::iter(due)
            .map(|f| {
                let reports = reports.clone();
                async move {
                    reports
                        .refresh(reports.source.as_ref(), &f)
                        .await
                        .0
                        .then_some(f)
                }
            })
            .buffer_unordered(config.concurrency.max(1))
            .filter_map(futures::future::ready)
            .collect()
            .await;
        changed.extend(reports.take_noticed());
        let mut models_to_wake: HashSet<ModelRef> = HashSet::new();
        let mut plugins_to_wake: HashSet<String> = HashSet::new();
        for f in changed {
            if !f.model.is_empty() {
                models_to_wake.insert(ObjectRef::new(&f.model).within(&f.namespace));
            }
            plugins_to_wake.extend(f.plugins);
        }
        for model in models_to_wake {
            if model_trigger.send(model).await.is_err() {
                return;
            }
        }
        for plugin in plugins_to_wake {
            if plugin_trigger.send(ObjectRef::new(&plugin)).await.is_err() {
                return;
            }
        }
    }
}
