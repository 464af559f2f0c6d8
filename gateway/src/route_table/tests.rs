//! The route table's pick, placements and replica bookkeeping, without a network.

use gantry_api::LoadState;

use super::*;
use crate::affinity::{Bound, KeyKind, RouteKey};

/// The plain bound (no slack), as CHWBL defines it.
const CHWBL: Bound = Bound {
    load_factor: 1.25,
    slack: 0,
};
const EXACT: Bound = Bound {
    load_factor: 1.0,
    slack: 0,
};

fn spec(id: &str, urls: &[&str]) -> ModelSpec {
    ModelSpec {
        id: id.into(),
        endpoints: urls.iter().map(|u| (u.to_string(), true)).collect(),
        min_replicas: 1,
        max_replicas: 1,
        failed: false,
        target: None,
        created: 0,
        node_token: None,
        adapters: Vec::new(),
    }
}

#[test]
fn pick_prefers_the_replica_with_fewer_outstanding_plus_waiting() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a", "http://b"])]);
    let route = t.get("m").expect("route");
    let first = t.pick(&route, &[]).expect("pick");
    let second = t.pick(&route, &[]).expect("pick");
    assert_ne!(first.replica.url, second.replica.url);
    // b reports a queue: a wins while it has fewer in total.
    let b = route
        .replicas
        .iter()
        .find(|r| r.url == "http://b")
        .expect("b");
    t.probed(b, true, 5, Vec::new(), 0);
    drop(second);
    drop(first);
    for _ in 0..3 {
        let l = t.pick(&route, &[]).expect("pick");
        assert_eq!(l.replica.url, "http://a");
        std::mem::forget(l);
    }
}

fn prefix_key(text: &str) -> RouteKey {
    RouteKey {
        hash: crate::hash::hash64(&[text.as_bytes()]),
        kind: KeyKind::Prefix,
    }
}

#[test]
fn a_key_sticks_to_its_replica_until_that_replica_passes_the_load_bound() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
    let route = t.get("m").expect("route");
    let key = prefix_key("conversation 1");
    let (first, rule) = t.pick_keyed(&route, &[], Some(key), CHWBL).expect("pick");
    assert_eq!(rule, Rule::Prefix);
    let home = first.replica.url.clone();
    drop(first);
    // Sequential requests of one conversation: always home.
    for _ in 0..5 {
        let (l, rule) = t.pick_keyed(&route, &[], Some(key), CHWBL).expect("pick");
        assert_eq!(
            (l.replica.url.as_str(), rule),
            (home.as_str(), Rule::Prefix)
        );
    }
    // Concurrent ones: home takes them while its load is within
    // ceil(1.25 x (total + 1) / 3); past that the next replica on the ring takes over.
    let mut held = Vec::new();
    let mut homes = 0;
    for _ in 0..6 {
        let (l, _) = t.pick_keyed(&route, &[], Some(key), CHWBL).expect("pick");
        homes += usize::from(l.replica.url == home);
        held.push(l);
    }
    let loads: Vec<u64> = route.replicas.iter().map(|r| r.outstanding()).collect();
    assert!(homes >= 2, "home took {homes} of 6");
    assert!(homes < 6, "the bound never spilled: {loads:?}");
    // No replica above 1.25x the mean (rounded up), the point of the bound.
    let cap = crate::affinity::load_cap(6 - 1, 3, 1.25);
    assert!(loads.iter().all(|&l| l <= cap), "{loads:?} past {cap}");
}

/// The gateway's default bound: CHWBL's factor with a slack of 3 requests.
const SLACK3: Bound = Bound {
    load_factor: 1.25,
    slack: 3,
};

#[test]
fn a_conversation_stays_on_its_replica_until_that_one_is_far_busier_then_moves_for_good() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
    let route = t.get("m").expect("route");
    let key = prefix_key("conversation 7");
    let (first, _) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
    let home = first.replica.url.clone();
    // Two more of its requests at once: home is past CHWBL's cap (2 of 3 in flight) but
    // only 2 above the others, so it keeps them.
    let (second, _) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
    let (third, rule) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
    assert_eq!(
        (
            second.replica.url.as_str(),
            third.replica.url.as_str(),
            rule
        ),
        (home.as_str(), home.as_str(), Rule::Prefix)
    );
    // A fourth finds home 3 above an idle replica: it goes elsewhere...
    let (fourth, rule) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
    assert_ne!(fourth.replica.url, home);
    assert_eq!(rule, Rule::Prefix);
    let moved = fourth.replica.url.clone();
    drop((first, second, third, fourth));
    // ...and the conversation stays there once home is idle again: that replica now holds
    // its newest prompt.
    for _ in 0..3 {
        let (l, _) = t.pick_keyed(&route, &[], Some(key), SLACK3).expect("pick");
        assert_eq!(l.replica.url, moved);
    }
}

#[test]
fn new_conversations_spread_evenly_and_keep_their_replicas_across_snapshots() {
    let t = RouteTable::new(true);
    let urls = ["http://a", "http://b", "http://c"];
    t.replace(vec![spec("m", &urls)]);
    let route = t.get("m").expect("route");
    let keys: Vec<RouteKey> = (0..16)
        .map(|i| prefix_key(&format!("conversation {i}")))
        .collect();
    let mut home = HashMap::new();
    for k in &keys {
        let (l, rule) = t.pick_keyed(&route, &[], Some(*k), SLACK3).expect("pick");
        assert_eq!(rule, Rule::Prefix);
        home.insert(k.hash, l.replica.url.clone());
    }
    let per: Vec<usize> = urls
        .iter()
        .map(|u| home.values().filter(|h| h == u).count())
        .collect();
    // 16 keys on 3 replicas: 6/5/5 in some order, however the ring falls.
    assert_eq!(per.iter().max().copied(), Some(6), "{per:?}");
    assert_eq!(per.iter().min().copied(), Some(5), "{per:?}");
    assert_eq!(t.placements(), 16);
    // A new snapshot with the same replicas keeps every placement.
    t.replace(vec![spec("m", &urls)]);
    let route = t.get("m").expect("route");
    for k in &keys {
        let (l, _) = t.pick_keyed(&route, &[], Some(*k), SLACK3).expect("pick");
        assert_eq!(l.replica.url, home[&k.hash]);
    }
    // A replica gone: its keys move, the others stay.
    t.replace(vec![spec("m", &urls[..2])]);
    let route = t.get("m").expect("route");
    for k in &keys {
        let (l, _) = t.pick_keyed(&route, &[], Some(*k), SLACK3).expect("pick");
        if home[&k.hash] == "http://c" {
            assert_ne!(l.replica.url, "http://c");
        } else {
            assert_eq!(l.replica.url, home[&k.hash]);
        }
    }
}

#[test]
fn a_session_key_stays_on_the_ring_however_deep_the_queues_are() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a", "http://b"])]);
    let route = t.get("m").expect("route");
    // Both report a deep queue: the bound moves with the mean, so the key keeps its home.
    for r in &route.replicas {
        t.probed(r, true, 20, Vec::new(), 0);
    }
    let key = RouteKey {
        hash: 7,
        kind: KeyKind::Session,
    };
    let (l1, rule) = t.pick_keyed(&route, &[], Some(key), EXACT).expect("pick");
    assert_eq!(rule, Rule::Session);
    let home = l1.replica.url.clone();
    drop(l1);
    let (l2, _) = t.pick_keyed(&route, &[], Some(key), EXACT).expect("pick");
    assert_eq!(l2.replica.url, home);
    let (_l, rule) = t.pick_keyed(&route, &[], None, EXACT).expect("pick");
    assert_eq!(rule, Rule::LeastLoad);
}

#[test]
fn least_load_prefers_replicas_that_report_the_model_loaded() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a", "http://b"])]);
    let route = t.get("m").expect("route");
    let b = replica(&route, "http://b");
    // b is warm but busier; a would load the model first.
    t.probed(b, true, 3, vec![listed("m", LoadState::Loaded)], 0);
    for _ in 0..3 {
        let (l, rule) = t.pick_keyed(&route, &[], None, CHWBL).expect("pick");
        assert_eq!(
            (l.replica.url.as_str(), rule),
            ("http://b", Rule::LeastLoad)
        );
    }
}

fn listed(id: &str, state: LoadState) -> gantry_api::ModelStatus {
    gantry_api::ModelStatus {
        id: id.into(),
        format: "gguf".into(),
        architecture: None,
        verdict: None,
        artifact: Default::default(),
        load: gantry_api::LoadStatus {
            state,
            ..Default::default()
        },
        queue: Default::default(),
        devices: Vec::new(),
        replicas: Vec::new(),
        crashes: None,
        engine_choice: None,
        adapters: Vec::new(),
        draft: None,
    }
}

fn replica<'a>(route: &'a ModelRoute, url: &str) -> &'a Arc<Replica> {
    route
        .replicas
        .iter()
        .find(|r| r.url == url)
        .expect("replica")
}

#[test]
fn a_model_no_replica_has_loaded_goes_where_there_is_the_most_room() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
    let route = t.get("m").expect("route");
    const GIB: u64 = 1 << 30;
    // A pool's three pods list the model, none has loaded it; b has the most room but the
    // most waiting requests too: room decides, load only breaks ties.
    for (url, room, waiting) in [
        ("http://a", GIB, 0),
        ("http://b", 5 * GIB, 4),
        ("http://c", 3 * GIB, 0),
    ] {
        let r = replica(&route, url);
        t.probed(
            r,
            true,
            waiting,
            vec![listed("m", LoadState::Unloaded)],
            room,
        );
    }
    for key in [None, Some(prefix_key("You are terse."))] {
        let (l, rule) = t.pick_keyed(&route, &[], key, CHWBL).expect("pick");
        assert_eq!((l.replica.url.as_str(), rule), ("http://b", Rule::Cold));
    }
    // Equal room: the least loaded.
    t.probed(
        replica(&route, "http://c"),
        true,
        0,
        vec![listed("m", LoadState::Unloaded)],
        5 * GIB,
    );
    let (l, rule) = t.pick_keyed(&route, &[], None, CHWBL).expect("pick");
    assert_eq!((l.replica.url.as_str(), rule), ("http://c", Rule::Cold));
    // Once one has it loaded, the model stays there, prefix keys included.
    t.probed(
        replica(&route, "http://a"),
        true,
        0,
        vec![listed("m", LoadState::Loaded)],
        0,
    );
    for text in ["one system prompt", "another", "a third"] {
        let (l, rule) = t
            .pick_keyed(&route, &[], Some(prefix_key(text)), CHWBL)
            .expect("pick");
        assert_eq!(
            (l.replica.url.as_str(), rule),
            ("http://a", Rule::Prefix),
            "{text}"
        );
    }
}

#[test]
fn replicas_that_never_reported_keep_prefix_routing_over_all_of_them() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
    let route = t.get("m").expect("route");
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..64 {
        let (l, rule) = t
            .pick_keyed(&route, &[], Some(prefix_key(&format!("prompt {i}"))), CHWBL)
            .expect("pick");
        assert_eq!(rule, Rule::Prefix);
        seen.insert(l.replica.url.clone());
    }
    assert_eq!(
        seen.len(),
        3,
        "64 prefixes spread over every replica: {seen:?}"
    );
}

#[test]
fn a_replica_leaves_the_rotation_only_after_three_missed_probes_in_a_row() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a"])]);
    let route = t.get("m").expect("route");
    let a = &route.replicas[0];
    t.probed(a, true, 0, Vec::new(), 0);
    t.probe_missed(a);
    t.probe_missed(a);
    assert!(a.is_up(), "two slow answers keep a busy node in rotation");
    t.probed(a, true, 0, Vec::new(), 0);
    t.probe_missed(a);
    t.probe_missed(a);
    assert!(a.is_up(), "an answer resets the count");
    t.probe_missed(a);
    assert!(!a.is_up(), "the third miss in a row takes it out");
    assert_eq!(t.pick(&route, &[]).err(), Some(NoReplica::NoneReady));
    t.probed(a, true, 0, Vec::new(), 0);
    assert!(
        t.pick(&route, &[]).is_ok(),
        "the next answer brings it back"
    );
}

#[test]
fn replicas_survive_a_snapshot_with_their_counters() {
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a"])]);
    let lease = t.pick(&t.get("m").expect("m"), &[]).expect("pick");
    t.replace(vec![spec("m", &["http://a", "http://b"])]);
    let a = t.get("m").expect("m").replicas[0].clone();
    assert_eq!(a.outstanding(), 1);
    drop(lease);
    assert_eq!(a.outstanding(), 0);
}

#[test]
fn replicas_carry_their_models_token_or_the_default_and_a_new_token_is_a_new_replica() {
    let install: gantry_api::node_token::InstallToken =
        "0123456789abcdef0123456789abcdef".parse().expect("token");
    let t = RouteTable::new(true).with_default_node_token(Some(install.as_node_token()));
    let mut own = spec("own", &["http://a"]);
    own.node_token = Some(install.for_model("ns", "own"));
    t.replace(vec![own.clone(), spec("static", &["http://b"])]);
    let a = t.get("own").expect("own").replicas[0].clone();
    let b = t.get("static").expect("static").replicas[0].clone();
    let sent = |r: &Replica| r.node_token().map(|v| v.as_bytes().to_vec());
    assert_eq!(
        sent(&a),
        Some(install.for_model("ns", "own").as_str().as_bytes().to_vec())
    );
    assert!(a.node_token().is_some_and(HeaderValue::is_sensitive));
    assert_eq!(
        sent(&b),
        Some(install.as_node_token().as_str().as_bytes().to_vec())
    );
    // The same URL under the same token keeps its replica (and counters)...
    let lease = t.pick(&t.get("own").expect("own"), &[]).expect("pick");
    t.replace(vec![own.clone()]);
    assert!(Arc::ptr_eq(&a, &t.get("own").expect("own").replicas[0]));
    // ...but a pod IP reused by another Model's pod is a fresh replica with its token.
    own.node_token = Some(install.for_model("ns", "other"));
    t.replace(vec![own]);
    let c = t.get("own").expect("own").replicas[0].clone();
    assert!(!Arc::ptr_eq(&a, &c));
    assert_eq!(c.outstanding(), 0);
    assert_eq!(
        sent(&c),
        Some(
            install
                .for_model("ns", "other")
                .as_str()
                .as_bytes()
                .to_vec()
        )
    );
    drop(lease);
}

#[test]
fn failed_and_down_models_are_not_picked() {
    let t = RouteTable::new(false);
    let mut s = spec("m", &["http://a"]);
    t.replace(vec![s.clone()]);
    assert_eq!(
        t.pick(&t.get("m").expect("m"), &[]).err(),
        Some(NoReplica::NoneReady),
        "a static replica is down until probed"
    );
    s.failed = true;
    t.replace(vec![s]);
    assert_eq!(
        t.pick(&t.get("m").expect("m"), &[]).err(),
        Some(NoReplica::Failed)
    );
}

/// A node's report on model `id`, loaded, with its adapters `(id, name, state)`.
fn with_adapters(
    id: &str,
    adapters: &[(&str, &str, gantry_api::AdapterState)],
) -> gantry_api::ModelStatus {
    gantry_api::ModelStatus {
        adapters: adapters
            .iter()
            .map(|(id, name, state)| gantry_api::AdapterStatus {
                name: name.to_string(),
                id: id.to_string(),
                state: *state,
                reason: (*state == gantry_api::AdapterState::Refused).then(|| "mismatch".into()),
                message: (*state == gantry_api::AdapterState::Refused)
                    .then(|| "rank 16 does not fit the base model".into()),
                bytes: None,
            })
            .collect(),
        ..listed(id, LoadState::Loaded)
    }
}

#[test]
fn a_request_id_resolves_to_a_model_first_then_an_adapter_then_model_colon_name() {
    use gantry_api::AdapterState::Loaded;
    let t = RouteTable::new(true);
    let mut m = spec("m", &["http://a"]);
    // Declared by the source (a Model's spec.adapters): known before any report.
    m.adapters = vec!["m:declared".into()];
    t.replace(vec![m, spec("m:x", &["http://b"])]);
    let route = t.get("m").expect("m");
    t.probed(
        replica(&route, "http://a"),
        true,
        0,
        vec![with_adapters(
            "m",
            &[
                ("m:pirate", "pirate", Loaded),
                ("bot", "legal", Loaded),
                ("m:x", "x", Loaded),
            ],
        )],
        0,
    );
    let target = |id: &str| match t.resolve(id) {
        Target::Model(r) => format!("model {}", r.spec.id),
        Target::Adapter { route, id } => format!("adapter {id} of {}", route.spec.id),
        Target::UnknownAdapter { route, name } => format!("no adapter {name} of {}", route.spec.id),
        Target::NotFound => "not found".into(),
    };
    assert_eq!(target("m"), "model m");
    // A model id holding `:` is that model, even where an adapter claims the same id.
    assert_eq!(target("m:x"), "model m:x");
    assert_eq!(target("m:pirate"), "adapter m:pirate of m");
    // An adapter's own servedName, which need not hold its base's id at all.
    assert_eq!(target("bot"), "adapter bot of m");
    assert_eq!(target("m:declared"), "adapter m:declared of m");
    assert_eq!(target("m:nope"), "no adapter nope of m");
    assert_eq!(target("m:x:nope"), "no adapter nope of m:x");
    assert_eq!(target("other:pirate"), "not found");
    assert_eq!(target("gamma"), "not found");
    assert_eq!(
        route.adapter_ids(),
        ["bot", "m:declared", "m:pirate", "m:x"]
    );
}

#[test]
fn an_adapter_goes_to_a_replica_that_has_it_loaded_and_never_to_one_that_refused_it() {
    use gantry_api::AdapterState::{Downloaded, Loaded, Refused};
    let t = RouteTable::new(true);
    t.replace(vec![spec("m", &["http://a", "http://b", "http://c"])]);
    let route = t.get("m").expect("m");
    // a has the adapter loaded but is the busiest; b has its files; c refused it.
    for (url, waiting, state) in [
        ("http://a", 4, Loaded),
        ("http://b", 0, Downloaded),
        ("http://c", 0, Refused),
    ] {
        t.probed(
            replica(&route, url),
            true,
            waiting,
            vec![with_adapters("m", &[("m:pirate", "pirate", state)])],
            0,
        );
    }
    for key in [
        None,
        Some(prefix_key("Arr, matey")),
        Some(prefix_key("Ahoy")),
    ] {
        let (l, _) = t
            .pick_served(&route, Some("m:pirate"), &[], key, SLACK3)
            .expect("pick");
        assert_eq!(l.replica.url, "http://a", "{key:?}");
    }
    // The base model itself goes by load as before: not to busy a.
    let (l, rule) = t.pick_served(&route, None, &[], None, EXACT).expect("pick");
    assert_ne!(l.replica.url, "http://a");
    assert_eq!(rule, Rule::LeastLoad);
    drop(l);
    // a gone: the adapter loads where its files are, never on c.
    for _ in 0..3 {
        let (l, _) = t
            .pick_served(&route, Some("m:pirate"), &["http://a".into()], None, EXACT)
            .expect("pick");
        assert_eq!(l.replica.url, "http://b");
    }
    assert!(route.refusal("m:pirate").is_none(), "a and b serve it");
    // Refused everywhere: no replica, and the route says why.
    t.probed(
        replica(&route, "http://b"),
        true,
        0,
        vec![with_adapters("m", &[("m:pirate", "pirate", Refused)])],
        0,
    );
    assert_eq!(
        t.pick_served(&route, Some("m:pirate"), &["http://a".into()], None, EXACT)
            .err(),
        Some(NoReplica::AdapterRefused)
    );
    t.probed(
        replica(&route, "http://a"),
        true,
        0,
        vec![with_adapters("m", &[("m:pirate", "pirate", Refused)])],
        0,
    );
    let refusal = route.refusal("m:pirate").expect("refused everywhere");
    assert_eq!(refusal.reason.as_deref(), Some("mismatch"));
    // The base model still serves on all three.
    assert!(t.pick_served(&route, None, &[], None, EXACT).is_ok());
}
