//! Operator tests in one binary (one link step): CRDs, the pure build and validate steps,
//! generated objects against the Kubernetes types, reconciles against a mock API server, and
//! the autoscaler's decisions on recorded metric series, and the controller's caches and the
//! triggers their watches send.

mod adapters;
mod autoscale;
mod autoscale_interval;
mod build;
mod build_engines;
mod caching;
mod cli;
mod crds;
mod deliver;
mod deliver_plan;
mod deliver_pod_state;
mod deliver_pool;
mod grammar;
mod isolation;
mod leader;
mod node_report;
mod objects;
mod plugin;
mod pool;
mod pool_admission;
mod pool_autoscale;
mod rbac;
mod rbac_table;
mod reconcile;
mod reconcile_engine;
mod reconcile_errors;
mod reconcile_replicas;
mod reconcile_secret;
mod structural_schema;
mod support;
mod validate;
