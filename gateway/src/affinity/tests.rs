//! Routing keys and the hash ring, without a network.

use super::*;
use axum::http::HeaderValue;

fn chat(messages: &[(&str, &str)]) -> Vec<u8> {
    let m: Vec<serde_json::Value> = messages
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": m})).expect("json")
}

fn key(body: &[u8]) -> Option<RouteKey> {
    route_key(body, &HeaderMap::new(), &Affinity::default())
}

#[test]
fn later_turns_of_a_conversation_share_its_key() {
    let system = ("system", "You are a careful assistant. ".repeat(20));
    let turn1 = chat(&[(system.0, &system.1), ("user", "Plan a trip to Kyoto.")]);
    let turn3 = chat(&[
        (system.0, &system.1),
        ("user", "Plan a trip to Kyoto."),
        ("assistant", "Day 1: temples."),
        ("user", "And day 2?"),
    ]);
    let k1 = key(&turn1).expect("keyed");
    assert_eq!(k1.kind, KeyKind::Prefix);
    assert_eq!(Some(k1), key(&turn3));
}

#[test]
fn conversations_that_share_only_a_system_prompt_get_different_keys() {
    let system = "You are a careful assistant.";
    let a = key(&chat(&[
        ("system", system),
        ("user", "Plan a trip to Kyoto."),
    ]));
    let b = key(&chat(&[("system", system), ("user", "Explain monads.")]));
    assert_ne!(a, b);
}

#[test]
fn a_long_system_prompt_does_not_hide_the_first_user_message() {
    let system = "x".repeat(5000);
    let a = key(&chat(&[
        ("system", &system),
        ("user", "Plan a trip to Kyoto."),
    ]));
    let b = key(&chat(&[("system", &system), ("user", "Explain monads.")]));
    assert_ne!(a, b);
}

#[test]
fn content_parts_are_read_as_their_text() {
    let parts = serde_json::json!({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}
    ]});
    let joined = chat(&[("user", "Hello there")]);
    assert_eq!(
        key(&serde_json::to_vec(&parts).expect("json")),
        key(&joined)
    );
}

#[test]
fn a_session_header_wins_over_the_prefix() {
    let mut h = HeaderMap::new();
    h.insert(DEFAULT_SESSION_HEADER, HeaderValue::from_static("user-42"));
    let a = Affinity::default();
    let k1 = route_key(&chat(&[("user", "one")]), &h, &a).expect("keyed");
    let k2 = route_key(&chat(&[("user", "two")]), &h, &a).expect("keyed");
    assert_eq!(k1.kind, KeyKind::Session);
    assert_eq!(k1, k2);
}

#[test]
fn completions_are_keyed_by_the_start_of_the_prompt() {
    let a = Affinity {
        prefix_chars: 16,
        ..Affinity::default()
    };
    let body = |p: &str| {
        serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": p})).expect("json")
    };
    let h = HeaderMap::new();
    let k1 = route_key(&body("0123456789abcdef and then one"), &h, &a);
    let k2 = route_key(&body("0123456789abcdef and then two"), &h, &a);
    let k3 = route_key(&body("0123456789abcdeX and then one"), &h, &a);
    assert!(k1.is_some());
    assert_eq!(k1, k2);
    assert_ne!(k1, k3);
    // Truncation counts characters, not bytes: multi-byte text is cut on a boundary.
    let k4 = route_key(&body(&"é".repeat(40)), &h, &a);
    let k5 = route_key(&body(&format!("{}x", "é".repeat(16))), &h, &a);
    assert_eq!(k4, k5);
}

#[test]
fn no_key_without_text_or_in_least_load_mode() {
    assert_eq!(key(br#"{"model": "m", "input": "embed me"}"#), None);
    assert_eq!(key(br#"{"model": "m", "prompt": ""}"#), None);
    assert_eq!(key(b"not json"), None);
    let least = Affinity {
        mode: RoutingMode::LeastLoad,
        ..Affinity::default()
    };
    assert_eq!(
        route_key(&chat(&[("user", "hi")]), &HeaderMap::new(), &least),
        None
    );
}

#[test]
fn the_ring_splits_keys_evenly_and_a_removed_replica_moves_only_its_own_keys() {
    let urls = [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    ];
    let ring = Ring::new(urls);
    let n = 6000u64;
    let owner = |r: &Ring, k: u64, count: usize| r.walk(hash64(&[&k.to_be_bytes()]), count)[0];
    let mut counts = [0u64; 3];
    for k in 0..n {
        counts[owner(&ring, k, 3)] += 1;
    }
    for c in counts {
        // Each replica within 15 % of an even third.
        assert!(
            (c as f64 - n as f64 / 3.0).abs() < 0.15 * n as f64 / 3.0,
            "uneven split: {counts:?}"
        );
    }
    // Without the third replica, keys of the first two stay where they were.
    let two = Ring::new(urls[..2].iter().copied());
    for k in 0..n {
        let before = owner(&ring, k, 3);
        if before != 2 {
            assert_eq!(owner(&two, k, 2), before, "key {k} moved");
        }
    }
}

#[test]
fn a_walk_visits_every_replica_once() {
    let ring = Ring::new(["a", "b", "c", "d"]);
    let mut w = ring.walk(12345, 4);
    w.sort_unstable();
    assert_eq!(w, vec![0, 1, 2, 3]);
}

#[test]
fn the_load_cap_is_the_mean_times_the_factor_rounded_up() {
    // Nothing running on 3 replicas: the first request may go anywhere (cap 1).
    assert_eq!(load_cap(0, 3, 1.25), 1);
    // 8 running on 3: (8 + 1) / 3 × 1.25 = 3.75 -> 4.
    assert_eq!(load_cap(8, 3, 1.25), 4);
    assert_eq!(load_cap(5, 0, 1.25), 0);
}

#[test]
fn invalid_routing_flags_are_refused_by_name() {
    let args = |load_factor: f64, prefix_chars: usize, header: &str| RoutingArgs {
        routing: RoutingMode::Prefix,
        prefix_chars,
        load_factor,
        load_slack: DEFAULT_LOAD_SLACK,
        placement_ttl_seconds: 600,
        session_header: header.into(),
    };
    assert!(
        args(0.9, 10, "x")
            .affinity()
            .expect_err("refused")
            .contains("--load-factor")
    );
    assert!(
        args(f64::NAN, 10, "x")
            .affinity()
            .expect_err("refused")
            .contains("--load-factor")
    );
    assert!(
        args(1.25, 0, "x")
            .affinity()
            .expect_err("refused")
            .contains("--prefix-chars")
    );
    assert!(
        args(1.25, 10, "bad header")
            .affinity()
            .expect_err("refused")
            .contains("--session-header")
    );
    assert_eq!(
        args(1.25, 10, "").affinity().expect("valid").session_header,
        None
    );
    let mut no_ttl = args(1.25, 10, "x");
    no_ttl.placement_ttl_seconds = 0;
    assert!(
        no_ttl
            .affinity()
            .expect_err("refused")
            .contains("--placement-ttl-seconds")
    );
}

#[test]
fn a_replica_is_over_the_bound_only_past_both_the_cap_and_the_slack() {
    let b = Bound {
        load_factor: 1.25,
        slack: 3,
    };
    // 4 in flight on 3 replicas (cap 2): 2 on one replica is past the cap but only 2 above
    // the least loaded, so it keeps its keys; 3 is over.
    assert!(!b.over(2, 3, 0, 3));
    assert!(b.over(3, 3, 0, 3));
    // Deep queues everywhere: the cap decides (30 on 3, cap 13; min 9 + 3 = 12).
    assert!(!b.over(12, 30, 9, 3));
    assert!(b.over(13, 30, 9, 3));
    // Slack 0 is the plain bound.
    let plain = Bound { slack: 0, ..b };
    assert!(plain.over(2, 3, 2, 3));
    assert!(!plain.over(1, 3, 0, 3));
}
