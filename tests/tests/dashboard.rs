//! The chart's Grafana dashboard (outside the request path: what operators of a cluster look at)
//! queries only metrics that exist: every `gantry_*` name in its panels must be a family the
//! node, the operator or the gateway registers, read from their own registries, not a list.

use std::collections::BTreeSet;
use std::path::Path;

fn dashboard_metric_names() -> BTreeSet<String> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/gantry/files/grafana-dashboard.json");
    let text = std::fs::read_to_string(&path).expect("dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut names = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("expr");
            // Metric names: `gantry_` followed by lower-case letters and underscores.
            let mut rest = expr;
            while let Some(i) = rest.find("gantry_") {
                let tail = &rest[i..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                    .unwrap_or(tail.len());
                names.insert(tail[..end].to_string());
                rest = &tail[end..];
            }
        }
    }
    names
}

#[test]
fn the_dashboard_queries_only_registered_metric_families() {
    let mut registered: BTreeSet<String> = BTreeSet::new();
    registered.extend(gantry_node::metrics::Metrics::new().family_names());
    registered.extend(
        gantry_operator::metrics::Metrics::new()
            .expect("operator metrics")
            .family_names(),
    );
    registered.extend(
        gantry_gateway::metrics::GatewayMetrics::new()
            .expect("gateway metrics")
            .family_names(),
    );
    assert!(
        registered.iter().any(|n| n.starts_with("gantry_gateway_")),
        "the gateway's families are read: {registered:?}"
    );
    let used = dashboard_metric_names();
    assert!(!used.is_empty(), "the dashboard queries something");
    for name in &used {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        assert!(
            registered.contains(name) || registered.contains(family),
            "{name} is not a registered Gantry metric family (registered: {registered:?})"
        );
    }
}
