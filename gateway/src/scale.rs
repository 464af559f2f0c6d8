//! Scale-up requests (scale from zero, before a held request): the gateway asks the controller
//! for a first replica by stamping the Model's node Deployment.
//!
//! The contract with the autoscaler: a JSON merge patch on the Deployment (`names::owned_name`
//! of the Model, same namespace) setting annotation `gantry.dev/scale-up-requested-at` to the
//! RFC 3339 UTC time, under field manager `gantry-gateway`, at most once per model per
//! [`SCALE_UP_MIN_INTERVAL`]. Behind [`Scaler`] so tests without a cluster record the calls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use gantry_crd::names::ANNOTATION_SCALE_UP_REQUESTED;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, Patch, PatchParams};

use crate::route_table::ScaleTarget;

/// Field manager (and user agent) of the gateway's one write.
pub const GATEWAY_FIELD_MANAGER: &str = "gantry-gateway";
/// At most one scale-up request per model in this interval.
pub const SCALE_UP_MIN_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    #[error("cannot annotate Deployment {namespace}/{name}: {source}")]
    Patch {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// Asks for a first replica of a model.
pub trait Scaler: Send + Sync + 'static {
    fn request_scale_up<'a>(
        &'a self,
        model: &'a str,
        target: Option<&'a ScaleTarget>,
    ) -> BoxFuture<'a, Result<(), ScaleError>>;
}

/// The in-cluster scaler: annotates the node Deployment.
#[derive(Clone)]
pub struct KubeScaler {
    client: kube::Client,
}

impl std::fmt::Debug for KubeScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeScaler")
    }
}

impl KubeScaler {
    pub fn new(client: kube::Client) -> Self {
        KubeScaler { client }
    }
}

/// The merge patch body (shared with the tests that assert it).
pub fn scale_up_patch(now: &str) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {ANNOTATION_SCALE_UP_REQUESTED: now}}})
}

impl Scaler for KubeScaler {
    fn request_scale_up<'a>(
        &'a self,
        _model: &'a str,
        target: Option<&'a ScaleTarget>,
    ) -> BoxFuture<'a, Result<(), ScaleError>> {
        Box::pin(async move {
            // A static-file model has no Deployment: nothing to ask.
            let Some(t) = target else { return Ok(()) };
            let api = Api::<Deployment>::namespaced(self.client.clone(), &t.namespace);
            let now = k8s_openapi::jiff::Timestamp::now().to_string();
            let params = PatchParams {
                field_manager: Some(GATEWAY_FIELD_MANAGER.to_string()),
                ..PatchParams::default()
            };
            api.patch(&t.deployment, &params, &Patch::Merge(scale_up_patch(&now)))
                .await
                .map(|_| ())
                .map_err(|source| ScaleError::Patch {
                    namespace: t.namespace.clone(),
                    name: t.deployment.clone(),
                    source,
                })
        })
    }
}

/// One recorded scale-up request: the model id and its Deployment, if any.
pub type ScaleCall = (String, Option<ScaleTarget>);

/// A scaler that only records what it was asked (tests and the static endpoint source).
#[derive(Clone, Debug, Default)]
pub struct RecordingScaler {
    calls: Arc<Mutex<Vec<ScaleCall>>>,
}

impl RecordingScaler {
    /// Every request so far: model id and target.
    pub fn calls(&self) -> Vec<ScaleCall> {
        self.calls.lock().map(|c| c.clone()).unwrap_or_default()
    }
}

impl Scaler for RecordingScaler {
    fn request_scale_up<'a>(
        &'a self,
        model: &'a str,
        target: Option<&'a ScaleTarget>,
    ) -> BoxFuture<'a, Result<(), ScaleError>> {
        if let Ok(mut c) = self.calls.lock() {
            c.push((model.to_string(), target.cloned()));
        }
        Box::pin(async { Ok(()) })
    }
}

/// Rate-limits scale-up requests per model and runs them off the request path.
pub struct ScaleRequests {
    scaler: Arc<dyn Scaler>,
    last: Mutex<HashMap<String, Instant>>,
}

impl std::fmt::Debug for ScaleRequests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScaleRequests")
    }
}

impl ScaleRequests {
    pub fn new(scaler: Arc<dyn Scaler>) -> Self {
        ScaleRequests {
            scaler,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Ask for a replica of `model` unless asked within the last [`SCALE_UP_MIN_INTERVAL`].
    /// Returns whether a request was sent (spawned; a failure is logged and retried by the
    /// next held request after the interval).
    pub fn request(&self, model: &str, target: Option<ScaleTarget>) -> bool {
        let now = Instant::now();
        {
            let Ok(mut last) = self.last.lock() else {
                return false;
            };
            if last
                .get(model)
                .is_some_and(|t| now.duration_since(*t) < SCALE_UP_MIN_INTERVAL)
            {
                return false;
            }
            last.insert(model.to_string(), now);
        }
        let scaler = Arc::clone(&self.scaler);
        let model = model.to_string();
        tokio::spawn(async move {
            match scaler.request_scale_up(&model, target.as_ref()).await {
                Ok(()) => tracing::info!(%model, "requested a scale-up from zero"),
                Err(e) => tracing::warn!(%model, error = %e, "scale-up request failed"),
            }
        });
        true
    }
}
