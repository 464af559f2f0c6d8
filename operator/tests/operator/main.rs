//! Operator tests in one binary (one link step): CRDs, the pure build and validate steps,
//! generated objects against the Kubernetes types, and reconciles against a mock API server.

mod build;
mod crds;
mod gateway_kube;
mod leader;
mod node_report;
mod objects;
mod plugin;
mod reconcile;
mod support;
mod validate;
