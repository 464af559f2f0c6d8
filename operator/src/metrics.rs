//! Controller metrics (around every reconcile): reconcile counts, errors by kind, durations,
//! API writes and leadership, served as Prometheus text on `/metrics`.
//!
//! `gantry_operator_writes_total` is the number to watch for hot loops: at
//! steady state it stays flat while `gantry_operator_reconciles_total` grows.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use prometheus::core::Collector;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// The controller's metrics and their registry.
pub struct Metrics {
    registry: Registry,
    /// Reconciles started, by controller (`model`, `engineplugin`).
    pub reconciles: IntCounterVec,
    /// Failed reconciles, by controller and error (`metric_label()` of the step error).
    pub errors: IntCounterVec,
    /// Reconcile wall time, by controller.
    pub duration: HistogramVec,
    /// API writes, by controller, object kind and verb (`apply`, `apply_status`, `delete`, `event`).
    pub writes: IntCounterVec,
    /// 1 while this replica holds the leader Lease.
    pub leader: IntGauge,
    /// Objects each controller cache holds, by store.
    pub cache_objects: IntGaugeVec,
    /// What each controller cache holds, by store, as serialized JSON bytes (a measure of
    /// what the trimmed objects keep, not of the allocator's heap).
    pub cache_bytes: IntGaugeVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// The name of every metric family registered here, also those with no sample yet (which
    /// `/metrics` leaves out); the dashboard test checks its queries against these.
    pub fn family_names(&self) -> Vec<String> {
        let collectors: [&dyn Collector; 7] = [
            &self.reconciles,
            &self.errors,
            &self.duration,
            &self.writes,
            &self.leader,
            &self.cache_objects,
            &self.cache_bytes,
        ];
        collectors
            .iter()
            .flat_map(|c| c.desc())
            .map(|d| d.fq_name.clone())
            .collect()
    }

    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new("gantry_operator_reconciles_total", "Reconciles started."),
            &["controller"],
        )?;
        let errors = IntCounterVec::new(
            Opts::new(
                "gantry_operator_reconcile_errors_total",
                "Reconciles that failed, by error kind.",
            ),
            &["controller", "error"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "gantry_operator_reconcile_duration_seconds",
                "Reconcile wall time.",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            &["controller"],
        )?;
        let writes = IntCounterVec::new(
            Opts::new(
                "gantry_operator_writes_total",
                "Writes to the Kubernetes API, by object kind and verb.",
            ),
            &["controller", "kind", "verb"],
        )?;
        let leader = IntGauge::new(
            "gantry_operator_leader",
            "1 while this replica holds the leader Lease.",
        )?;
        registry.register(Box::new(reconciles.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(writes.clone()))?;
        let cache_objects = IntGaugeVec::new(
            Opts::new(
                "gantry_operator_cache_objects",
                "Objects held by each controller cache.",
            ),
            &["store"],
        )?;
        let cache_bytes = IntGaugeVec::new(
            Opts::new(
                "gantry_operator_cache_bytes",
                "Serialized JSON size of what each controller cache holds.",
            ),
            &["store"],
        )?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(cache_objects.clone()))?;
        registry.register(Box::new(cache_bytes.clone()))?;
        Ok(Metrics {
            registry,
            reconciles,
            errors,
            duration,
            writes,
            leader,
            cache_objects,
            cache_bytes,
        })
    }

    /// Count a reconcile and time it until the guard drops.
    pub fn reconcile_started(&self, controller: &'static str) -> ReconcileTimer<'_> {
        self.reconciles.with_label_values(&[controller]).inc();
        ReconcileTimer {
            metrics: self,
            controller,
            start: Instant::now(),
        }
    }

    pub fn reconcile_failed(&self, controller: &str, error: &str) {
        self.errors.with_label_values(&[controller, error]).inc();
    }

    /// Record what the controller caches hold: `(store, objects, serialized bytes)`.
    pub fn caches_hold(&self, stores: &[(&str, usize, usize)]) {
        for (store, objects, bytes) in stores {
            let as_gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
            self.cache_objects
                .with_label_values(&[*store])
                .set(as_gauge(*objects));
            self.cache_bytes
                .with_label_values(&[*store])
                .set(as_gauge(*bytes));
        }
    }

    pub fn wrote(&self, controller: &str, kind: &str, verb: &str) {
        self.writes
            .with_label_values(&[controller, kind, verb])
            .inc();
    }

    /// Total writes so far (tests and the zero-write check).
    pub fn total_writes(&self) -> u64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == "gantry_operator_writes_total")
            .flat_map(|f| f.get_metric().iter())
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    }

    /// Prometheus text exposition of every metric.
    pub fn encode(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// Observes the reconcile duration when dropped.
pub struct ReconcileTimer<'a> {
    metrics: &'a Metrics,
    controller: &'static str,
    start: Instant,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        self.metrics
            .duration
            .with_label_values(&[self.controller])
            .observe(self.start.elapsed().as_secs_f64());
    }
}

/// Serve `/metrics` and `/healthz` on `addr` until the process exits.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    use axum::{Router, http::StatusCode, http::header, routing::get};
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    match metrics.encode() {
                        Ok(text) => (
                            StatusCode::OK,
                            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                            text,
                        ),
                        Err(e) => (
                            StatusCode::INTERNAL_SERVER_ERROR,
                            [(header::CONTENT_TYPE, "text/plain")],
                            e.to_string(),
                        ),
                    }
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app).await
}
