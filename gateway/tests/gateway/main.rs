//! Gateway tests on loopback (outside the reconcile path, on the gateway's request path): real
//! `gantry-node` processes serving a tiny GGUF through the llama.cpp plugin, fed to an
//! in-process gateway through the static endpoint source.
//!
//! Needs `cargo build --release --workspace --all-targets` first (the node binary and the
//! plugin are read from the build output), which scripts/test.sh does. `kube_api` needs no
//! node: it checks discovery and the scale-up request against a mock API server; nor does
//! `adapters`, whose fake nodes report fixed adapter states.

mod adapters;
mod kube_api;
mod streams;
mod support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use gantry_gateway::GatewaySettings;
use gantry_gateway::affinity::RoutingMode;
use serde_json::{Value, json};

use support::*;

fn completion(model: &str, max_tokens: u32) -> Value {
    json!({"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0})
}

fn streaming(model: &str, max_tokens: u32) -> Value {
    json!({"model": model, "prompt": "Tell me a long story", "max_tokens": max_tokens,
           "temperature": 0, "stream": true})
}

fn assert_openai_error(v: &Value, code: &str, param: Option<&str>) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert_eq!(e["code"], code, "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_route_by_model_and_refusals_have_the_openai_shape() {
    let _cpu = measuring().await;
    let a = Node::start("alpha", free_port());
    let b = Node::start("beta", free_port());
    let gw = Gateway::start(
        json!({"models": {"alpha": [a.base], "beta": [b.base]}}),
        GatewaySettings {
            max_body_bytes: 64 * 1024,
            ..fast_settings()
        },
        None,
    )
    .await;
    a.wait_ready().await;
    b.wait_ready().await;
    gw.wait_routable("alpha").await;
    gw.wait_routable("beta").await;

    for _ in 0..3 {
        let (s, v) = gw
            .post("/v1/completions", completion("alpha", 2), None)
            .await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["model"], "alpha");
    }
    let (s, v) = gw
        .post("/v1/completions", completion("beta", 2), None)
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["model"], "beta");
    // Each node saw only its own model's requests.
    assert_eq!(a.requests_ok("alpha").await, 3.0);
    assert_eq!(b.requests_ok("beta").await, 1.0);

    let (s, v) = gw.get("/v1/models", None).await;
    assert_eq!(s, 200);
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["alpha", "beta"]);

    let (s, v) = gw
        .post("/v1/completions", completion("gamma", 2), None)
        .await;
    assert_eq!(s, 404);
    assert_openai_error(&v, "model_not_found", Some("model"));
    let (s, v) = gw
        .post_raw("/v1/chat/completions", "{\"model\": ", None)
        .await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "invalid_value", None);
    let (s, v) = gw
        .post("/v1/chat/completions", json!({"messages": []}), None)
        .await;
    assert_eq!(s, 400);
    assert_openai_error(&v, "invalid_value", Some("model"));
    let big = json!({"model": "alpha", "prompt": "x".repeat(100 * 1024)});
    let (s, v) = gw.post("/v1/completions", big, None).await;
    assert_eq!(s, 413);
    assert_openai_error(&v, "request_too_large", None);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("65536"),
        "{v}"
    );

    let metrics = gw.metrics().await;
    promtool_check(&metrics);
    assert_eq!(
        metric(
            &metrics,
            "gantry_gateway_requests_total{code=\"200\",model=\"alpha\"}"
        ),
        Some(3.0)
    );
    assert_eq!(
        metric(
            &metrics,
            "gantry_gateway_requests_total{code=\"404\",model=\"\"}"
        ),
        Some(1.0)
    );
    assert!(metric(&metrics, "gantry_gateway_overhead_seconds_count").is_some_and(|n| n >= 4.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_load_spreads_across_replicas_within_one_and_a_half_shares() {
    let _cpu = measuring().await;
    let (nodes, gw) = two_nodes_behind_a_gateway(fast_settings()).await;
    // 48 requests, 8 at a time, of uneven lengths. Two shared cores can starve one node for a
    // moment, and least-loaded routing rightly favours the faster one; so a skewed burst is
    // run again (at most three bursts, counted separately). Wrong routing skews every burst.
    let total = 48usize;
    let mut before = [0.0, 0.0];
    let mut bursts = Vec::new();
    let counts = loop {
        let results = futures::stream::iter(0..total)
            .map(|i| {
                let gw = &gw;
                async move {
                    gw.post(
                        "/v1/completions",
                        completion("tiny", 4 + (i % 5) as u32 * 6),
                        None,
                    )
                    .await
                    .0
                }
            })
            .buffer_unordered(8)
            .collect::<Vec<u16>>()
            .await;
        assert!(results.iter().all(|s| *s == 200), "{results:?}");
        let after = [
            nodes[0].requests_ok("tiny").await,
            nodes[1].requests_ok("tiny").await,
        ];
        let counts = [after[0] - before[0], after[1] - before[1]];
        before = after;
        assert_eq!(counts[0] + counts[1], total as f64, "{counts:?}");
        bursts.push(counts);
        let even = counts.iter().all(|c| *c <= 1.5 * total as f64 / 2.0);
        if even || bursts.len() == 3 {
            break counts;
        }
    };
    let share = total as f64 / 2.0;
    // On failure, say whether the gateway routed around a replica (retries, back-offs) or the
    // replicas simply ran at different speeds.
    let routing: Vec<String> = gw
        .metrics()
        .await
        .lines()
        .filter(|l| {
            l.starts_with("gantry_gateway_retries") || l.starts_with("gantry_gateway_upstream")
        })
        .map(str::to_string)
        .collect();
    for c in counts {
        assert!(
            c <= 1.5 * share,
            "one replica got {c} of {total}: bursts {bursts:?}; gateway: {routing:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_turn_of_a_conversation_goes_to_the_replica_that_served_its_first() {
    let _cpu = measuring().await;
    // The key is a completion's first 48 characters: each conversation's own opening.
    let mut settings = fast_settings();
    settings.affinity.prefix_chars = 48;
    let (nodes, gw) = two_nodes_behind_a_gateway(settings).await;
    // Six conversations of three turns, one after another: each turn's prompt repeats the
    // conversation's opening and adds to it, as a chat client's history does.
    let conversations = 6;
    for c in 0..conversations {
        let before = [
            nodes[0].requests_ok("tiny").await,
            nodes[1].requests_ok("tiny").await,
        ];
        let mut prompt = format!("Conversation {c}: a shared opening that the node caches.");
        for turn in 0..3 {
            prompt.push_str(&format!(" Turn {turn}."));
            let (status, body) = gw
                .post(
                    "/v1/completions",
                    json!({"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}),
                    None,
                )
                .await;
            assert_eq!(status, 200, "{body}");
        }
        let after = [
            nodes[0].requests_ok("tiny").await,
            nodes[1].requests_ok("tiny").await,
        ];
        let got = [after[0] - before[0], after[1] - before[1]];
        assert!(
            got == [3.0, 0.0] || got == [0.0, 3.0],
            "conversation {c} was split over the replicas: {got:?}"
        );
    }
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "gantry_gateway_routed_total{model=\"tiny\",rule=\"prefix\"}"
        ),
        Some(f64::from(conversations * 3))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_a_node_fails_only_its_in_flight_requests_and_new_ones_go_to_the_survivor() {
    let _cpu = measuring().await;
    // Identical prompts: least-load routing puts two streams on each node (prefix routing
    // would keep them together up to its load bound).
    let mut settings = fast_settings();
    settings.affinity.mode = RoutingMode::LeastLoad;
    let ([mut doomed, survivor], gw) = two_nodes_behind_a_gateway(settings).await;
    // Four long streams, two on each node (least-loaded alternates them).
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(
            gw.stream("/v1/completions", streaming("tiny", 400), None)
                .await,
        );
    }
    for n in [&doomed, &survivor] {
        n.wait_running(2).await;
    }
    let handles: Vec<_> = streams
        .into_iter()
        .map(|rx| tokio::spawn(drain(rx)))
        .collect();
    doomed.kill();
    let mut outcomes = Vec::new();
    for h in handles {
        outcomes.push(
            tokio::time::timeout(Duration::from_secs(30), h)
                .await
                .expect("stream ended")
                .expect("join"),
        );
    }
    // All four were admitted before the kill (`wait_running` above); the killed node's two may
    // not have sent a first event yet on a loaded machine.
    let completed = outcomes.iter().filter(|o| o.finished).count();
    assert_eq!(
        completed, 2,
        "only the killed node's two streams fail: {outcomes:?}"
    );
    assert!(
        outcomes
            .iter()
            .filter(|o| o.finished)
            .all(|o| o.events > 400),
        "the survivor's streams ran to the end: {outcomes:?}"
    );
    // New requests: all answered, by the survivor, even though the dead node is still listed.
    for _ in 0..6 {
        let (s, v) = gw
            .post("/v1/completions", completion("tiny", 2), None)
            .await;
        assert_eq!(s, 200, "{v}");
    }
    // Its two streams and the six new requests (a stream is counted as it closes: poll).
    survivor.wait_requests_ok("tiny", 8.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scale_from_zero_holds_a_request_until_a_node_started_20_s_later_answers_it() {
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let scaler = gantry_gateway::scale::RecordingScaler::default();
    let gw = Gateway::start(
        json!({"models": {"cold": {"endpoints": [base], "minReplicas": 0, "maxReplicas": 1}}}),
        GatewaySettings {
            max_held_per_model: 1,
            ..fast_settings()
        },
        Some(scaler.clone()),
    )
    .await;
    // Listed while at zero: it can scale up.
    let (_, models) = gw.get("/v1/models", None).await;
    assert_eq!(models["data"][0]["id"], "cold", "{models}");
    let t0 = Instant::now();
    let held = tokio::spawn({
        let gw = gw.clone();
        async move {
            gw.post("/v1/completions", completion("cold", 2), None)
                .await
        }
    });
    // The bound: a second request for the same model is refused at once with Retry-After.
    let held_now = async {
        loop {
            if metric(
                &gw.metrics().await,
                "gantry_gateway_held_requests{model=\"cold\"}",
            ) == Some(1.0)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), held_now)
        .await
        .expect("the first request is held");
    let t1 = Instant::now();
    let r = reqwest_client()
        .post(format!("{}/v1/completions", gw.base))
        .json(&completion("cold", 2))
        .send()
        .await
        .expect("second");
    assert_eq!(r.status(), 503);
    assert!(t1.elapsed() < Duration::from_secs(1), "refused at once");
    let retry_after: u64 = r.headers()["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert!(retry_after > 0);
    assert_openai_error(&r.json().await.expect("json"), "unavailable", None);
    assert_eq!(
        scaler.calls(),
        vec![("cold".to_string(), None)],
        "one scale-up request"
    );

    tokio::time::sleep(Duration::from_secs(20).saturating_sub(t0.elapsed())).await;
    assert!(!held.is_finished(), "still held after 20 s");
    // Starting a node loads a model: keep that off the cores while another test measures.
    let _cpu = measuring().await;
    let node = Node::start("cold", port);
    let (s, v) = tokio::time::timeout(Duration::from_secs(30), held)
        .await
        .expect("answered")
        .expect("join");
    assert_eq!(s, 200, "{v}");
    assert!(t0.elapsed() >= Duration::from_secs(20));
    assert_eq!(node.requests_ok("cold").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_keys_allow_deny_and_restrict_models_without_reaching_a_node() {
    let _cpu = measuring().await;
    let node = Node::start("alpha", free_port());
    let keys = tempfile::NamedTempFile::new().expect("keys file");
    std::fs::write(
        keys.path(),
        "everything: {key: sk-all}\nalpha-only: {key: sk-alpha, models: [alpha]}\nbeta-only: {key: sk-beta, models: [beta]}\n",
    )
    .expect("write keys");
    let gw = Gateway::start_with_keys(
        json!({"models": {"alpha": [node.base], "beta": [node.base]}}),
        fast_settings(),
        keys.path(),
    )
    .await;
    node.wait_ready().await;
    gw.wait_routable_with("alpha", Some("sk-all")).await;

    let (s, v) = gw
        .post("/v1/completions", completion("alpha", 2), None)
        .await;
    assert_eq!(s, 401);
    assert_openai_error(&v, "invalid_api_key", None);
    let (s, v) = gw
        .post("/v1/completions", completion("alpha", 2), Some("sk-wrong"))
        .await;
    assert_eq!(s, 401);
    assert_openai_error(&v, "invalid_api_key", None);
    let (s, v) = gw
        .post("/v1/completions", completion("alpha", 2), Some("sk-beta"))
        .await;
    assert_eq!(s, 403);
    assert_openai_error(&v, "model_not_allowed", Some("model"));
    let (s, _) = gw.get("/v1/models", None).await;
    assert_eq!(s, 401);
    assert_eq!(
        node.requests_total().await,
        0.0,
        "no refused call reached the node"
    );

    let (s, v) = gw
        .post("/v1/completions", completion("alpha", 2), Some("sk-alpha"))
        .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = gw
        .post("/v1/completions", completion("alpha", 2), Some("sk-all"))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(node.requests_total().await, 2.0);
    let (_, v) = gw.get("/v1/models", Some("sk-beta")).await;
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["beta"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_sends_its_node_token_and_never_a_callers() {
    let _cpu = measuring().await;
    let install: gantry_api::node_token::InstallToken =
        "0123456789abcdef0123456789abcdef0123456789abcdef"
            .parse()
            .expect("token");
    // Static endpoints: the node runs with the install token itself.
    let node = Node::start_with_token("alpha", free_port(), Some(install.as_node_token().as_str()));
    let gw = Gateway::start(
        json!({"models": {"alpha": [node.base]}}),
        GatewaySettings {
            node_token: Some(install.clone()),
            ..fast_settings()
        },
        None,
    )
    .await;
    node.wait_ready().await;
    // Routable means the prober's `/v1/status` call, which needs the token too, got through.
    gw.wait_routable("alpha").await;

    let (s, v) = gw
        .post("/v1/completions", completion("alpha", 2), None)
        .await;
    assert_eq!(s, 200, "{v}");
    // A caller's own X-Gantry-Node-Token is dropped: were it forwarded, the node would read
    // it first and refuse the request.
    let r = reqwest_client()
        .post(format!("{}/v1/completions", gw.base))
        .header("X-Gantry-Node-Token", "forged-forged-forged-forged-forged")
        .json(&completion("alpha", 2))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 200);

    // The node itself refuses a caller without the token, in OpenAI's shape.
    let direct = reqwest_client()
        .post(format!("{}/v1/completions", node.base))
        .json(&completion("alpha", 2))
        .send()
        .await
        .expect("direct");
    assert_eq!(direct.status(), 401);
    let v: Value = direct.json().await.expect("json");
    assert_openai_error(&v, "node_token_required", None);
    assert_eq!(node.requests_ok("alpha").await, 2.0);

    // A gateway without the token cannot use the node: the prober never sees it ready.
    let blind = Gateway::start(
        json!({"models": {"alpha": [node.base]}}),
        fast_settings(),
        None,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (s, v) = blind.get("/v1/models", None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["data"],
        json!([]),
        "a node refusing the probe is not listed"
    );
}
