//! Gateway metrics (around every proxied request): requests by model and code, the latency the
//! gateway adds, held requests, upstream errors and retries, served on the gateway's `/metrics`.
//!
//! `gantry_gateway_overhead_seconds` is the gateway's own time on a request, measured on its
//! own clock: from the request's arrival at the handler to the moment the upstream request is
//! handed to the HTTP client (auth, body read, parse, pick, and any hold or retry wait), plus
//! from the upstream response headers' arrival to handing them to the server for the client.
//! It excludes the node's time and the network between; time spent holding for a replica
//! (scale from zero) is in `gantry_gateway_hold_seconds` instead, not here.

use prometheus::core::Collector;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

pub struct GatewayMetrics {
    registry: Registry,
    /// Requests answered, by model (`""` when no model is known yet) and HTTP code.
    pub requests: IntCounterVec,
    /// Gateway-added time per request (see the module doc).
    pub overhead: Histogram,
    /// Time requests spent held for a first replica, by outcome.
    pub hold: HistogramVec,
    /// Requests held now, by model.
    pub held: IntGaugeVec,
    /// Upstream failures by model and kind (`connect`, `unavailable`, `request`, `body`).
    pub upstream_errors: IntCounterVec,
    /// Retries on another replica, by model.
    pub retries: IntCounterVec,
    /// Requests routed, by model and rule (`session`, `prefix`, `least_load`).
    pub routed: IntCounterVec,
    /// Routing-key placements remembered now (set at each scrape).
    pub placements: IntGauge,
    /// Connections at the edge (gantry-edge).
    pub edge: std::sync::Arc<gantry_edge::EdgeMetrics>,
}

impl std::fmt::Debug for GatewayMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GatewayMetrics")
    }
}

impl GatewayMetrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "gantry_gateway_requests_total",
                "Requests answered by the gateway, by model and HTTP status code.",
            ),
            &["model", "code"],
        )?;
        let overhead = Histogram::with_opts(
            HistogramOpts::new(
                "gantry_gateway_overhead_seconds",
                "Time the gateway adds to a request: arrival to upstream send, plus upstream headers to client headers.",
            )
            .buckets(vec![
                0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
            ]),
        )?;
        let hold = HistogramVec::new(
            HistogramOpts::new(
                "gantry_gateway_hold_seconds",
                "Time requests were held waiting for a first ready replica, by outcome.",
            )
            .buckets(vec![
                0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0,
            ]),
            &["outcome"],
        )?;
        let held = IntGaugeVec::new(
            Opts::new(
                "gantry_gateway_held_requests",
                "Requests held now waiting for a ready replica, by model.",
            ),
            &["model"],
        )?;
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                "gantry_gateway_upstream_errors_total",
                "Upstream failures, by model and kind (connect, unavailable, request, body).",
            ),
            &["model", "kind"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "gantry_gateway_retries_total",
                "Requests retried on another replica before the first response byte.",
            ),
            &["model"],
        )?;
        let routed = IntCounterVec::new(
            Opts::new(
                "gantry_gateway_routed_total",
                "Requests placed on a replica, by model and rule (cold: no replica had the model loaded, the one with the most memory room; session, prefix: the replica the key last went to, or its place on the ring, within the load bound; least_load: no key, or no replica within the bound).",
            ),
            &["model", "rule"],
        )?;
        let placements = IntGauge::new(
            "gantry_gateway_placements",
            "Routing keys (sessions, prompt prefixes) whose replica this gateway remembers; each is forgotten --placement-ttl-seconds after its last request.",
        )?;
        registry.register(Box::new(placements.clone()))?;
        registry.register(Box::new(routed.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(overhead.clone()))?;
        registry.register(Box::new(hold.clone()))?;
        registry.register(Box::new(held.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        let edge = std::sync::Arc::new(gantry_edge::EdgeMetrics::register(
            &registry,
            "gantry_gateway",
        )?);
        Ok(GatewayMetrics {
            edge,
            registry,
            requests,
            overhead,
            hold,
            held,
            upstream_errors,
            retries,
            routed,
            placements,
        })
    }

    /// The name of every metric family registered here, also those with no sample yet (which
    /// `/metrics` leaves out); the dashboard test checks its queries against these.
    pub fn family_names(&self) -> Vec<String> {
        let collectors: [&dyn Collector; 8] = [
            &self.routed,
            &self.placements,
            &self.requests,
            &self.overhead,
            &self.hold,
            &self.held,
            &self.upstream_errors,
            &self.retries,
        ];
        let mut names: Vec<String> = collectors
            .iter()
            .flat_map(|c| c.desc())
            .map(|d| d.fq_name.clone())
            .collect();
        names.extend(self.edge.family_names());
        names
    }

    /// Prometheus text exposition.
    pub fn encode(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}
