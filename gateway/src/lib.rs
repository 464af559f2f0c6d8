//! The in-cluster OpenAI gateway (data-plane edge, `gantry-operator run --components gateway`):
//! one endpoint for every Model, in front of the node pods.
//!
//! Request path: [`router()`] (the gateway's HTTP routes, sharing one [`GatewayState`]) →
//! [`proxy`] (auth from [`auth`], body, `model`, routing key from [`affinity`]) →
//! [`route_table`] (the model or LoRA adapter `model` names; the key's last replica from
//! [`placement`] or its place on the ring, within a load bound, else the least loaded; held
//! while none is ready, asking [`scale`] for one) → upstream node → response relayed
//! unbuffered. `GET /v1/models` is [`models`]. Discovery feeds [`route_table`]:
//! [`kube_source`] (Models + EndpointSlices reflectors) in a cluster, [`static_source`] (a YAML
//! file) elsewhere; [`probe`] polls every replica's `/v1/status` for readiness and queue depth.
//! The gateway keeps no state worth electing a leader for: replicas run active-active.
//! docs/gateway.md describes it for users.
//!
//! The gateway shares only the custom resources, object names and condition reasons with the
//! operator (through `gantry-crd`); the `gantry-operator` binary starts it through [`serve`]
//! with a [`GatewayConfig`] built from [`GatewayArgs`]. This file only wires the modules.
#![forbid(unsafe_code)]

pub mod affinity;
pub mod auth;
mod body;
pub mod error;
pub mod hash;
pub mod kube_source;
pub mod metrics;
pub mod models;
pub mod placement;
pub mod probe;
pub mod proxy;
pub mod route_table;
mod router;
pub mod scale;
mod server;
mod settings;
mod state;
pub mod static_source;

/// The route table's former path (before it was named for what it holds), kept for callers.
pub use route_table as routes;
pub use router::router;
pub use server::{Discovery, GatewayConfig, ServeError, serve, upstream_client};
pub use settings::{GatewayArgs, GatewaySettings};
pub use state::GatewayState;
