//! Model and EnginePlugin reconcile, read step: fetching node pods' status documents
//! (`GET /v1/status`, [`gantry_api::NodeStatus`]) over HTTP.
//!
//! The source is a trait so that reconcile tests can serve fixed documents
//! without a network; the HTTP implementation is tested against a real
//! loopback server.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::node_pod::NodePod;
use futures::future::BoxFuture;
use gantry_api::{CrashStatus, NODE_STATUS_PATH, NodeStatus};

use gantry_api::node_token::{InstallToken, NODE_TOKEN_HEADER};
use gantry_crd::names::{ANNOTATION_CONFIG_HASH, LABEL_MODEL};

/// Why a node pod's status could not be read. Never fails a reconcile: the pod is
/// reported as silent and the status says so.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("cannot reach {url}: {message}")]
    Unreachable { url: String, message: String },
    #[error("{url} answered {status}")]
    BadStatus { url: String, status: u16 },
    #[error("{url} returned a document that is not a NodeStatus: {message}")]
    Malformed { url: String, message: String },
}

impl ReportError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            ReportError::Unreachable { .. } => "unreachable",
            ReportError::BadStatus { .. } => "bad_status",
            ReportError::Malformed { .. } => "malformed",
        }
    }
}

/// The Model a node pod serves (its node token is derived from this).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelRef<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
}

/// Where node status documents come from.
pub trait NodeStatusSource: Send + Sync {
    /// The status document of the node pod at `pod_ip`, serving `model`.
    fn fetch<'a>(
        &'a self,
        pod_ip: &'a str,
        model: ModelRef<'a>,
    ) -> BoxFuture<'a, Result<NodeStatus, ReportError>>;
}

/// Reads `http://{pod_ip}:{port}/v1/status` with a short timeout, sending the Model's node
/// token when the operator has an install token.
pub struct HttpNodeStatus {
    client: reqwest::Client,
    port: u16,
    install: Option<InstallToken>,
}

impl HttpNodeStatus {
    pub fn new(port: u16) -> Result<Self, reqwest::Error> {
        // A slow node must not hold a reconcile for long; it is asked again next time.
        Self::with_timeout(port, Duration::from_secs(2))
    }

    /// A source whose requests give up after `timeout` (the autoscaler's is shorter than its
    /// interval).
    pub fn with_timeout(port: u16, timeout: Duration) -> Result<Self, reqwest::Error> {
        // No idle connections are kept: a pod is asked once per 10–60 s, and a pool holding a
        // connection (with its buffers) to each of 1,000 pods costs tens of MiB for nothing.
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(1)))
            .pool_max_idle_per_host(0)
            .build()?;
        Ok(HttpNodeStatus {
            client,
            port,
            install: None,
        })
    }

    /// Send each Model's node token (derived from `install`) with every request.
    pub fn with_install_token(mut self, install: Option<InstallToken>) -> Self {
        self.install = install;
        self
    }
}

impl NodeStatusSource for HttpNodeStatus {
    fn fetch<'a>(
        &'a self,
        pod_ip: &'a str,
        model: ModelRef<'a>,
    ) -> BoxFuture<'a, Result<NodeStatus, ReportError>> {
        Box::pin(async move {
            // IPv6 pod IPs need brackets in a URL.
            let host = if pod_ip.contains(':') {
                format!("[{pod_ip}]")
            } else {
                pod_ip.to_string()
            };
            let url = format!("http://{host}:{}{NODE_STATUS_PATH}", self.port);
            let mut req = self.client.get(&url);
            if let Some(install) = &self.install {
                let token = install.for_model(model.namespace, model.name);
                let mut value =
                    reqwest::header::HeaderValue::from_str(token.as_str()).map_err(|e| {
                        ReportError::Unreachable {
                            url: url.clone(),
                            message: format!("node token is not a header value: {e}"),
                        }
                    })?;
                value.set_sensitive(true);
                req = req.header(NODE_TOKEN_HEADER, value);
            }
            let resp = req.send().await.map_err(|e| ReportError::Unreachable {
                url: url.clone(),
                message: e.to_string(),
            })?;
            if !resp.status().is_success() {
                return Err(ReportError::BadStatus {
                    url,
                    status: resp.status().as_u16(),
                });
            }
            resp.json::<NodeStatus>()
                .await
                .map_err(|e| ReportError::Malformed {
                    url,
                    message: e.to_string(),
                })
        })
    }
}

/// Fixed documents by pod IP: for tests and dry runs without node pods.
#[derive(Clone, Debug, Default)]
pub struct FixedNodeStatus(pub BTreeMap<String, NodeStatus>);

impl NodeStatusSource for FixedNodeStatus {
    fn fetch<'a>(
        &'a self,
        pod_ip: &'a str,
        _model: ModelRef<'a>,
    ) -> BoxFuture<'a, Result<NodeStatus, ReportError>> {
        let found = self.0.get(pod_ip).cloned();
        Box::pin(async move {
            found.ok_or_else(|| ReportError::Unreachable {
                url: pod_ip.to_string(),
                message: "no fixed status for this pod".to_string(),
            })
        })
    }
}

/// One node pod and what it reported.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeReport {
    /// `namespace/name`.
    pub pod: String,
    /// The pod template's config hash, to tell current pods from ones still rolling out.
    pub config_hash: Option<String>,
    /// EnginePlugin names mounted into the pod.
    pub plugins: Vec<String>,
    pub status: Result<NodeStatus, ReportError>,
}

impl NodeReport {
    /// The entry for model `id` in this pod's status document, if it answered and lists it.
    pub fn model(&self, id: &str) -> Option<&gantry_api::ModelStatus> {
        self.status
            .as_ref()
            .ok()
            .and_then(|s: &NodeStatus| s.models.iter().find(|m| m.id == id))
    }
}

/// How long an engine worker's crash counts as recent: the node's quiet minute
/// (node-pod/src/node/crash.rs `QUIET`), after which its restart backoff starts over.
pub const CRASH_QUIET_SECONDS: u64 = 60;

/// Whether a model's crash record is recent: the last crash less than
/// [`CRASH_QUIET_SECONDS`] ago, or a restart still waiting out its backoff.
pub fn crash_is_recent(c: &CrashStatus) -> bool {
    c.restart_in_seconds > 0 || c.seconds_ago < CRASH_QUIET_SECONDS
}

/// Running pods with an IP; the others cannot answer yet.
pub fn reachable(pod: &NodePod) -> Option<&str> {
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    status.pod_ip.as_deref().filter(|ip| !ip.is_empty())
}

/// What a node pod's metadata says about its report: who to ask and what the answer is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// `namespace/name`.
    pub pod: String,
    pub uid: String,
    pub ip: String,
    pub namespace: String,
    /// The Model the pod serves (its `gantry.dev/model` label).
    pub model: String,
    pub config_hash: Option<String>,
    pub plugins: Vec<String>,
}

/// The facts of a reachable pod; `None` while it cannot answer.
pub fn facts(pod: &NodePod) -> Option<PodFacts> {
    let ip = reachable(pod)?.to_string();
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let model = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_MODEL))
        .cloned()
        .unwrap_or_default();
    let annotations = pod.metadata.annotations.as_ref();
    let config_hash = annotations.and_then(|a| a.get(ANNOTATION_CONFIG_HASH).cloned());
    let plugins = annotations
        .and_then(|a| a.get(gantry_crd::names::ANNOTATION_PLUGINS))
        .map(|p| {
            p.split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    Some(PodFacts {
        pod: format!("{namespace}/{name}"),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        ip,
        namespace,
        model,
        config_hash,
        plugins,
    })
}

/// Ask one pod for its status document.
pub async fn fetch(source: &dyn NodeStatusSource, f: &PodFacts) -> Result<NodeStatus, ReportError> {
    source
        .fetch(
            &f.ip,
            ModelRef {
                namespace: &f.namespace,
                name: &f.model,
            },
        )
        .await
}
