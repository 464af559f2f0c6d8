//! Operator scale benchmark (outside the reconcile path), the node pods' side: the loopback
//! IPs the kubelet stand-in gives out, what each pod's `GET /v1/status` answers, and how many
//! were asked — apart from the API server's lock, which a long list holds.

use std::collections::HashMap;
use std::sync::Mutex;

use gantry_api::{
    ArtifactState, ArtifactStatus, EngineVerdict, LoadState, LoadStatus, ModelStatus, NodeStatus,
    QueueStatus,
};

#[derive(Default)]
pub struct NodeEndpoint {
    pub ips: Mutex<HashMap<String, String>>,
    pub requests: std::sync::atomic::AtomicU64,
}

impl NodeEndpoint {
    pub fn served(&self, ip: &str) -> Option<String> {
        self.requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.ips
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(ip)
            .cloned()
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Give the next free loopback IP to a pod serving `served`.
    pub fn add(&self, served: String) -> String {
        let mut ips = self
            .ips
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = ips.len();
        let ip = format!("127.{}.{}.{}", 1 + i / 62500, (i / 250) % 250, 1 + i % 250);
        ips.insert(ip.clone(), served);
        ip
    }
}

/// The node status document of model `served`, loaded and ready.
pub fn node_status(served: &str) -> NodeStatus {
    NodeStatus {
        version: "0.1.0".into(),
        backend: "cpu".into(),
        ready: true,
        draining: false,
        plugins: Vec::new(),
        models: vec![ModelStatus {
            id: served.into(),
            format: "gguf".into(),
            architecture: Some("gemma3".into()),
            verdict: Some(EngineVerdict::Supported {
                plugin: "llama_cpp".into(),
                version: "0.1.0".into(),
            }),
            artifact: ArtifactStatus {
                state: ArtifactState::Ready,
                bytes_done: 253_000_000,
                bytes_total: 253_000_000,
                bytes_per_second: 0.0,
                message: None,
            },
            load: LoadStatus {
                state: LoadState::Loaded,
                plugin: Some("llama_cpp".into()),
                ..Default::default()
            },
            queue: QueueStatus::default(),
            devices: Vec::new(),
            replicas: Vec::new(),
            crashes: None,
            engine_choice: None,
            adapters: Vec::new(),
            draft: None,
        }],
        ..NodeStatus::default()
    }
}
