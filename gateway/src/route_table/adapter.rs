//! What a request's `model` names (on the request path, after [`crate::proxy`] read the body,
//! before the pick): a model a discovery source serves, or a LoRA adapter of one — an id its
//! source declares (a Model's `spec.adapters`) or its replicas report
//! (`models[].adapters[].id` of `/v1/status`). An adapter's requests go to its base model's
//! replicas, preferring those that have it loaded (`pick.rs`).
//!
//! Resolution is exact first: a model id, then an adapter id (a `servedName` may hold `:`, so
//! `a:b` may be an adapter's own id, or even another model's). Only an id that is neither is
//! read as `<model>:<name>`, to tell a model that serves no such adapter from no model at all.

use std::collections::BTreeSet;
use std::sync::Arc;

use gantry_api::AdapterState;
use gantry_api::config::ADAPTER_SEPARATOR;

use super::{ModelRoute, RouteTable};

/// What a requested model id names.
#[derive(Clone, Debug)]
pub enum Target {
    /// A model: its own route.
    Model(Arc<ModelRoute>),
    /// An adapter (`id`) of the model whose route this is.
    Adapter { route: Arc<ModelRoute>, id: String },
    /// `<model>:<name>` of a model that serves no adapter of that name.
    UnknownAdapter {
        route: Arc<ModelRoute>,
        name: String,
    },
    /// Nothing the gateway serves.
    NotFound,
}

impl RouteTable {
    /// What `id` names: a model id exactly, else an adapter id exactly, else `<model>:<name>`.
    pub fn resolve(&self, id: &str) -> Target {
        let snapshot = self.snapshot();
        if let Some(route) = snapshot.get(id) {
            return Target::Model(Arc::clone(route));
        }
        // Two models claiming one adapter id: the first by id keeps it, whatever the map's
        // order (the operator refuses the overlap within a Model and within a pool).
        let owner = snapshot
            .values()
            .filter(|r| r.serves_adapter(id))
            .min_by(|a, b| a.spec.id.cmp(&b.spec.id));
        if let Some(route) = owner {
            return Target::Adapter {
                route: Arc::clone(route),
                id: id.to_string(),
            };
        }
        // An adapter name is a DNS label, so only the last separator can start one.
        if let Some((base, name)) = id.rsplit_once(ADAPTER_SEPARATOR)
            && let Some(route) = snapshot.get(base)
        {
            return Target::UnknownAdapter {
                route: Arc::clone(route),
                name: name.to_string(),
            };
        }
        Target::NotFound
    }
}

impl ModelRoute {
    /// Whether `id` is one of its adapters: declared by the source or listed by a replica.
    pub fn serves_adapter(&self, id: &str) -> bool {
        self.spec.adapters.iter().any(|a| a == id)
            || self
                .replicas
                .iter()
                .any(|r| r.lists_adapter(&self.spec.id, id))
    }

    /// Every adapter id it serves (declared or reported), sorted.
    pub fn adapter_ids(&self) -> Vec<String> {
        let mut ids: BTreeSet<String> = self.spec.adapters.iter().cloned().collect();
        for r in &self.replicas {
            ids.extend(r.adapter_ids(&self.spec.id));
        }
        ids.into_iter().collect()
    }

    /// What its replicas report about adapter `id`, by replica.
    pub fn adapter_reports(&self, id: &str) -> Vec<gantry_api::AdapterStatus> {
        self.replicas
            .iter()
            .filter_map(|r| r.adapter(&self.spec.id, id))
            .collect()
    }

    /// The first refusal when every replica that reports adapter `id` refused it (and at least
    /// one reports it): no replica can serve it until its spec or the node changes.
    pub fn refusal(&self, id: &str) -> Option<gantry_api::AdapterStatus> {
        let reports = self.adapter_reports(id);
        if reports.iter().all(|a| a.state == AdapterState::Refused) {
            reports.into_iter().next()
        } else {
            None
        }
    }
}
