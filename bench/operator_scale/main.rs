//! Operator scale benchmark (outside the reconcile path; `cargo run --release -p
//! gantry-operator --example operator-scale -- --scenario warm`): the real `gantry-operator`
//! binary, in its own process, against an in-memory Kubernetes API served on loopback by this
//! process (`apiserver`), with stand-ins for the controllers a cluster runs behind the
//! operator's objects (`cluster`: Deployment controller, scheduler, kubelet). Objects carry
//! what a real API server stores: managed fields per field manager, generations, ReplicaSets
//! and Pods behind every Deployment, Deployment and Pod status, Events. Node pods' `/v1/status`
//! is answered on port 8080 of their loopback pod IPs (127.x.y.z).
//!
//! Scenarios:
//! - `cold`: 1,000 new Models and nothing else. Each Deployment the operator creates gets a
//!   ReplicaSet and a Pending Pod. Once every Model has a status, the kubelet stand-in starts
//!   every Pod (Running, Ready, answering) and the run waits for every Model to be Ready.
//! - `pending`: the operator restarts in a cluster where the 1,000 Models' objects exist and
//!   every node pod is Pending (a cluster waiting for GPUs); no Model status yet.
//! - `warm`: like `pending`, but every node pod is Running, Ready and answering.
//!
//! Reports (JSON, `--out`): requests by verb while converging and afterwards in a quiet window
//! (`--quiet`, default 60 s, nothing changing), the operator's RSS and peak RSS, its CPU
//! seconds to converge, the wall time, the operator's cache gauges by store, and the node
//! status requests per second. Converged: every Model has a status with `observedGeneration`
//! and the autoscaler's decision (and, for `cold` once its pods run, `Ready=True`), and no
//! write has come for 5 s; bounded by `--timeout` seconds per phase.

mod apiserver;
mod cluster;
mod fields;
mod nodes;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use bytes::Bytes;
use gantry_crd::names::{AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER, owned_name};
use gantry_crd::{EnginePlugin, Model};
use gantry_operator::context::Settings;
use gantry_operator::model::{build, resolve::resolve, validate::validate};
use serde_json::{Value, json};

use apiserver::{Cluster, Shared, key_of, lock};
use fields::set_managed;

/// Models in the cluster (`--models`, default 1,000).
fn models() -> usize {
    arg("--models").and_then(|n| n.parse().ok()).unwrap_or(1000)
}
const NAMESPACE: &str = "bench";

/// Model `i` as `kubectl apply` (client-side) leaves it: the last-applied annotation and
/// kubectl's managed fields.
fn model(i: usize, template: &Value) -> Value {
    let mut m = template.clone();
    let name = format!("m-{i:04}");
    m["metadata"] = json!({"name": name, "namespace": NAMESPACE});
    m["spec"]["servedName"] = json!(name);
    m["metadata"]["annotations"] =
        json!({"kubectl.kubernetes.io/last-applied-configuration": m.to_string()});
    let config = m.clone();
    set_managed(&mut m, "kubectl-client-side-apply", "Update", None, &config);
    m
}

fn yaml<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc = text
        .split("\n---")
        .find(|d| d.contains("kind:"))
        .unwrap_or_default();
    serde_yaml::from_str(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Fill the cluster for `scenario`: what the operator, its autoscaler and the cluster's
/// controllers would have written for each Model, through the same server-side apply.
fn populate(c: &mut Cluster, scenario: &str, repo: &std::path::Path) {
    let mut plugin: Value = yaml(&repo.join("docs/examples/engineplugin-llama-cpp-cpu.yaml"));
    let plugins: Vec<EnginePlugin> = vec![serde_json::from_value(plugin.clone()).expect("plugin")];
    plugin["metadata"]["annotations"] =
        json!({"kubectl.kubernetes.io/last-applied-configuration": plugin.to_string()});
    let config = plugin.clone();
    set_managed(
        &mut plugin,
        "kubectl-client-side-apply",
        "Update",
        None,
        &config,
    );
    c.upsert("gantry.dev/v1alpha1/engineplugins", plugin);
    let template: Value = yaml(&repo.join("docs/examples/model-gemma-3-270m.yaml"));
    for i in 0..models() {
        let m = c.upsert("gantry.dev/v1alpha1/models", model(i, &template));
        if scenario == "cold" {
            continue;
        }
        let typed: Model = serde_json::from_value(m).expect("model");
        let v = validate(&typed, &Settings::default()).expect("valid");
        let r = resolve(&v, Some("gemma3"), &plugins, 1);
        let o = build::build(&v, &r.mounted(), &Settings::default()).expect("build");
        let owned = owned_name(&v.name);
        let key = (NAMESPACE.to_string(), owned.clone());
        let apply = |c: &mut Cluster, collection: &str, obj: Value, manager: &str| {
            c.apply(collection, &key, &obj, manager, false);
        };
        apply(
            c,
            "v1/configmaps",
            serde_json::to_value(&o.config_map).expect("json"),
            FIELD_MANAGER,
        );
        apply(
            c,
            "v1/services",
            serde_json::to_value(&o.service).expect("json"),
            FIELD_MANAGER,
        );
        // Created as the operator creates it: with the initial count, then the count handed
        // to the autoscaler's field manager.
        let mut d = serde_json::to_value(&o.deployment).expect("json");
        d["spec"]["replicas"] = json!(o.initial_replicas);
        apply(c, "apps/v1/deployments", d, FIELD_MANAGER);
        let replicas = json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": owned, "namespace": NAMESPACE}, "spec": {"replicas": o.initial_replicas}});
        apply(c, "apps/v1/deployments", replicas, AUTOSCALER_FIELD_MANAGER);
        cluster::sync_deployment(c, &key);
    }
    if scenario == "warm" {
        cluster::start_pods(c);
    }
}

/// Every Model has a status for its generation, the autoscaler's decision among it once its
/// Deployment exists (and, with `ready`, says Ready).
fn converged(c: &Cluster, ready: bool) -> bool {
    let deployments = c.collections.get("apps/v1/deployments");
    c.collections
        .get("gantry.dev/v1alpha1/models")
        .is_some_and(|col| {
            col.objects.len() == models()
                && col.objects.values().all(|m| {
                    let deployed = deployments.is_some_and(|d| d.objects.contains_key(&key_of(m)));
                    m["status"]["observedGeneration"] == json!(1)
                        && (!deployed || m["status"]["autoscaling"].is_object())
                        && (!ready
                            || m["status"]["conditions"].as_array().is_some_and(|cs| {
                                cs.iter()
                                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
                            }))
                })
        })
}

fn writes(requests: &BTreeMap<String, u64>) -> u64 {
    requests
        .iter()
        .filter(|(k, _)| !k.starts_with("LIST ") && !k.starts_with("WATCH "))
        .map(|(_, n)| *n)
        .sum()
}

fn diff(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, n)| (k.clone(), n - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// (RSS, peak RSS) in KiB and CPU seconds of a process, from /proc.
fn proc_stats(pid: u32) -> (u64, u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |field: &str| {
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15; after the command name they are 12 and 13 (0-based 11, 12).
    let ticks: f64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|t| t.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    (kib("VmRSS:"), kib("VmHWM:"), ticks / 100.0)
}

/// The operator's `gantry_operator_cache_objects` and `_bytes` gauges, by store.
async fn cache_gauges(addr: SocketAddr) -> Value {
    let text = match reqwest::get(format!("http://{addr}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(e) => return json!(format!("metrics not read: {e}")),
    };
    let mut stores = serde_json::Map::new();
    for line in text.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let field = if series.starts_with("gantry_operator_cache_objects{") {
            "objects"
        } else if series.starts_with("gantry_operator_cache_bytes{") {
            "bytes"
        } else {
            continue;
        };
        let store = series.split('"').nth(1).unwrap_or_default().to_string();
        let n: f64 = value.parse().unwrap_or(0.0);
        stores.entry(store).or_insert_with(|| json!({}))[field] = json!(n);
    }
    Value::Object(stores)
}

/// Threads of a process, from /proc.
fn proc_threads(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() {
    let scenario = arg("--scenario").unwrap_or_else(|| "warm".into());
    assert!(
        ["cold", "warm", "pending"].contains(&scenario.as_str()),
        "--scenario cold|warm|pending"
    );
    let timeout = Duration::from_secs(arg("--timeout").and_then(|t| t.parse().ok()).unwrap_or(120));
    let quiet = Duration::from_secs(arg("--quiet").and_then(|t| t.parse().ok()).unwrap_or(60));
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let exe = std::env::current_exe().expect("exe");
    let operator = arg("--operator").map(PathBuf::from).unwrap_or_else(|| {
        exe.parent()
            .and_then(|p| p.parent())
            .map(|p| p.join("gantry-operator"))
            .expect("target dir")
    });

    let mut cluster = Cluster::new();
    populate(&mut cluster, &scenario, &repo);
    let cluster: Shared = Arc::new(Mutex::new(cluster));

    // The API server.
    let api = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let api_addr: SocketAddr = api.local_addr().expect("addr");
    let c = cluster.clone();
    let app = axum::Router::new().fallback(
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            apiserver::handle(c.clone(), method, uri, headers, body)
        },
    );
    tokio::spawn(async move { axum::serve(api, app).await });
    // The node pods' status endpoint, on every loopback pod IP the kubelet stand-in gave out.
    let endpoint = lock(&cluster).nodes.clone();
    // The client asked for `http://{pod_ip}:8080/v1/status`: the Host header names the pod.
    let nodes = axum::Router::new().route(
        "/v1/status",
        axum::routing::get(move |headers: HeaderMap| {
            let endpoint = endpoint.clone();
            async move {
                let host = headers
                    .get("host")
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or_default();
                let ip = host.split(':').next().unwrap_or_default();
                let served = endpoint.served(ip);
                match served {
                    Some(served) => axum::Json(nodes::node_status(&served)).into_response(),
                    None => StatusCode::NOT_FOUND.into_response(),
                }
            }
        }),
    );
    let node_listener = tokio::net::TcpListener::bind("0.0.0.0:8080")
        .await
        .expect("port 8080 (the node port) must be free for the node status endpoint");
    tokio::spawn(async move { axum::serve(node_listener, nodes).await });

    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: bench\n  cluster:\n    server: http://{api_addr}\nusers:\n- name: bench\n  user: {{}}\ncontexts:\n- name: bench\n  context:\n    cluster: bench\n    user: bench\n    namespace: default\ncurrent-context: bench\n"
        ),
    )
    .expect("kubeconfig");
    // The operator's metrics port: its cache gauges are read at the end.
    let metrics_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let mut child = tokio::process::Command::new(&operator)
        .args([
            "run",
            "--components",
            "controller",
            "--no-leader-election",
            "--metrics-addr",
            &metrics_addr.to_string(),
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env(
            "GANTRY_LOG",
            std::env::var("OPERATOR_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env_remove("GANTRY_NODE_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", operator.display()));
    let pid = child.id().expect("pid");

    // Converged: the Models say what `converged` asks, and no write has come for `SETTLE`
    // (the autoscaler's decisions and the Events of the last statuses included); the time
    // reported is when the last write came.
    const SETTLE: Duration = Duration::from_secs(5);
    let wait = |ready: bool| {
        let cluster = cluster.clone();
        async move {
            let from = Instant::now();
            let (mut last_writes, mut last_change) = (u64::MAX, from);
            while from.elapsed() < timeout {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let c = lock(&cluster);
                let now_writes = writes(&c.requests);
                if now_writes != last_writes {
                    (last_writes, last_change) = (now_writes, Instant::now());
                }
                if converged(&c, ready) && last_change.elapsed() >= SETTLE {
                    return Some(last_change - from);
                }
            }
            None
        }
    };
    let converged_at = wait(false).await;
    let (rss_converged, _, cpu_converged) = proc_stats(pid);
    let mut at_converge = lock(&cluster).requests.clone();
    let to_converge = at_converge.clone();
    // `cold`, second phase: the pods start and every Model must turn Ready.
    let mut running = Value::Null;
    if scenario == "cold" {
        cluster::start_pods(&mut lock(&cluster));
        let ready_at = wait(true).await;
        let (rss, _, cpu) = proc_stats(pid);
        let requests = lock(&cluster).requests.clone();
        running = json!({
            "ready": ready_at.is_some(),
            "ready_wall_seconds": ready_at.map(|d| d.as_secs_f64()),
            "operator_cpu_seconds": cpu - cpu_converged,
            "operator_rss_mib_after_ready": rss as f64 / 1024.0,
            "requests": diff(&requests, &at_converge),
            "requests_per_model_excluding_list_watch":
                writes(&diff(&requests, &at_converge)) as f64 / models() as f64,
        });
        at_converge = requests;
    }
    let (rss_before_quiet, _, cpu_before_quiet) = proc_stats(pid);
    let (rv_before_quiet, status_before_quiet) = {
        let c = lock(&cluster);
        (c.rv(), c.nodes.requests())
    };
    tokio::time::sleep(quiet).await;
    let (rss, peak, cpu_end) = proc_stats(pid);
    let threads = proc_threads(pid);
    let (after, rv_after, objects, quiet_events) = {
        let c = lock(&cluster);
        // What the operator said in the quiet window: its Events by reason and note.
        let mut quiet_events: BTreeMap<String, u64> = BTreeMap::new();
        for e in c
            .collections
            .get("events.k8s.io/v1/events")
            .into_iter()
            .flat_map(|col| col.objects.values())
        {
            let rv: u64 = e["metadata"]["resourceVersion"]
                .as_str()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if rv > rv_before_quiet {
                let note = e["note"].as_str().unwrap_or_default();
                let key = format!("{}: {}", e["reason"].as_str().unwrap_or_default(), note);
                *quiet_events.entry(key).or_default() += 1;
            }
        }
        let objects: BTreeMap<String, usize> = c
            .collections
            .iter()
            .map(|(k, col)| (k.clone(), col.objects.len()))
            .collect();
        (c.requests.clone(), c.rv(), objects, quiet_events)
    };
    // What the autoscaler decided for each Model, by reason (its `status.autoscaling`).
    let mut autoscaling: BTreeMap<String, u64> = BTreeMap::new();
    for m in lock(&cluster)
        .collections
        .get("gantry.dev/v1alpha1/models")
        .into_iter()
        .flat_map(|col| col.objects.values())
    {
        let reason = m["status"]["autoscaling"]["reason"]
            .as_str()
            .unwrap_or("none");
        *autoscaling.entry(reason.to_string()).or_default() += 1;
    }
    let status_in_quiet = lock(&cluster).nodes.requests() - status_before_quiet;
    let caches = cache_gauges(metrics_addr).await;
    let _ = child.kill().await;

    let quiet_requests = diff(&after, &at_converge);
    let report = json!({
        "benchmark": "operator-scale",
        "scenario": scenario,
        "models": models(),
        "cluster_objects": objects,
        "operator_threads": threads,
        "operator_caches": caches,
        "converged": converged_at.is_some(),
        "converge_wall_seconds": converged_at.map(|d| d.as_secs_f64()),
        "operator_cpu_seconds_to_converge": cpu_converged,
        "operator_rss_mib_after_converge": rss_converged as f64 / 1024.0,
        "pods_started": running,
        "operator_rss_mib_before_quiet_window": rss_before_quiet as f64 / 1024.0,
        "operator_rss_mib_end": rss as f64 / 1024.0,
        "operator_peak_rss_mib": peak as f64 / 1024.0,
        "requests_to_converge": to_converge,
        "requests_to_converge_excluding_list_watch": writes(&to_converge),
        "requests_per_model_to_converge": writes(&to_converge) as f64 / models() as f64,
        "quiet_window_seconds": quiet.as_secs(),
        "watch_events_in_quiet_window": rv_after - rv_before_quiet,
        "requests_in_quiet_window": quiet_requests,
        "writes_in_quiet_window": writes(&quiet_requests),
        "events_in_quiet_window": quiet_events,
        "autoscaling_reasons_at_end": autoscaling,
        "node_status_requests_per_second_in_quiet_window":
            status_in_quiet as f64 / quiet.as_secs_f64(),
        "operator_cpu_seconds_in_quiet_window": cpu_end - cpu_before_quiet,
    });
    let text = serde_json::to_string_pretty(&report).expect("json");
    println!("{text}");
    if let Some(out) = arg("--out") {
        std::fs::write(&out, text + "\n").unwrap_or_else(|e| panic!("{out}: {e}"));
    }
}
