//! The Gantry operator (library half of the `gantry-operator` binary): the Model, ModelPool and
//! EnginePlugin reconcilers, the built-in autoscaler, leader election, controller metrics, CRD
//! generation and the RBAC table. The CRD types come from `gantry-crd`; the OpenAI gateway is
//! `gantry-gateway`, which `gantry-operator run --components gateway` starts ([`cli`]).
//!
//! A Model reconcile is a pipeline, each step its own module under [`model`]:
//! read → validate → resolve + build (pure) → apply → status. The
//! EnginePlugin reconcile ([`plugin`]) validates the spec and folds what node
//! pods report about the plugin. A ModelPool reconcile ([`pool`]) admits the
//! Models that name the pool and runs the Model pipeline's build and apply steps on the pool's
//! pod template. docs/operator.md walks one reconcile through these files.
#![forbid(unsafe_code)]

pub mod acceptance;
pub mod autoscale;
pub mod cli;
pub mod context;
pub mod controller;
pub mod crdgen;
pub mod leader;
pub mod malformed;
pub mod metrics;
pub mod model;
pub mod node_pod;
pub mod node_report;
pub mod plugin;
pub mod pool;
pub mod rbac;
pub mod report_cache;
pub mod watch_cache;
pub mod write;
