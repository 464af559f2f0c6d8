//! Streams through the gateway (its request path, a real node behind it): chunks pass through
//! one by one, and a client that hangs up frees its sequence on the node.

use std::time::{Duration, Instant};

use serde_json::json;

use super::streaming;
use super::support::*;

/// A node serving the tiny model and a gateway routing to it, both ready.
async fn tiny_behind_a_gateway() -> (Node, Gateway) {
    let node = Node::start("tiny", free_port());
    let gw = Gateway::start(
        json!({"models": {"tiny": [node.base]}}),
        fast_settings(),
        None,
    )
    .await;
    node.wait_ready().await;
    gw.wait_routable("tiny").await;
    (node, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_passes_through_chunk_by_chunk() {
    let _cpu = measuring().await;
    let (node, gw) = tiny_behind_a_gateway().await;
    let body = streaming("tiny", 300);
    // Same request (the response cache is off), direct and through the gateway. Timing on two
    // shared cores is noisy and the tiny model streams 300 tokens in well under a second, so
    // the pair is measured up to three times and the first clean try kept: a buffering proxy
    // would deliver its first event at the end of the stream on every try.
    let mut tries = Vec::new();
    let (direct, via) = loop {
        let direct = timed_events(
            reqwest_client()
                .post(format!("{}/v1/completions", node.base))
                .json(&body),
        )
        .await;
        let via = timed_events(
            reqwest_client()
                .post(format!("{}/v1/completions", gw.base))
                .json(&body),
        )
        .await;
        assert_eq!(direct.len(), via.len(), "same events through the gateway");
        assert!(via.len() > 100, "{} events", via.len());
        let late = [0, 1, 2, 5]
            .iter()
            .map(|&i| via[i].0.saturating_sub(direct[i].0))
            .max()
            .unwrap_or_default();
        let last = via.last().map(|e| e.0).unwrap_or_default();
        tries.push((late, via[0].0, via[10].0, last));
        let spread = via[0].0 < last / 4 && via[10].0 < last / 2;
        if (late <= Duration::from_millis(100) && spread) || tries.len() == 3 {
            break (direct, via);
        }
    };
    let last = via.last().map(|e| e.0).unwrap_or_default();
    // The first chunks arrive while the node is still generating, not all at the end.
    assert!(
        via[0].0 < last / 4,
        "first event at {:?} of {:?} (first, tenth and last per try: {tries:?})",
        via[0].0,
        last
    );
    assert!(
        via[10].0 < last / 2,
        "tenth event at {:?} of {:?} (first, tenth and last per try: {tries:?})",
        via[10].0,
        last
    );
    // And as early as they do direct, within scheduling noise.
    for i in [0, 1, 2, 5] {
        assert!(
            via[i].0 <= direct[i].0 + Duration::from_millis(100),
            "event {i}: {:?} through the gateway vs {:?} direct (lateness, first, tenth, last per try: {tries:?})",
            via[i].0,
            direct[i].0
        );
    }
    assert_eq!(via.last().map(|e| e.1.as_str()), Some("[DONE]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_disconnect_through_the_gateway_frees_the_sequence_on_the_node() {
    let _cpu = measuring().await;
    let (node, gw) = tiny_behind_a_gateway().await;
    let mut rx = gw
        .stream("/v1/completions", streaming("tiny", 1800), None)
        .await;
    for _ in 0..3 {
        rx.recv().await.expect("a chunk");
    }
    assert_eq!(node.running().await, 1);
    drop(rx);
    let t0 = Instant::now();
    while node.running().await != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "the node still runs the sequence"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(&metrics, "gantry_gateway_held_requests{model=\"tiny\"}").unwrap_or(0.0),
        0.0
    );
}
