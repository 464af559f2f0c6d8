//! Built-in autoscaler, the decide step, pure: its decisions over recorded metric series (one
//! sample per 5 s interval, the Deployment following each decision as the apiserver would), the
//! policy read from the spec, and every reason it gives documented.

use std::time::Duration;

use gantry_api::QueueStatus;
use gantry_crd::Autoscaling;
use gantry_operator::autoscale::decide::{
    Decision, History, Observation, PodLoad, Policy, SMOOTHING_SAMPLES, reason,
};
use gantry_operator::context::Settings;
use gantry_operator::model::validate::validate;
use k8s_openapi::jiff::Timestamp;

use crate::support::{fixture_model, t0};

pub(crate) const INTERVAL: i64 = 5;

pub(crate) fn at(secs: i64) -> Timestamp {
    Timestamp::from_second(t0().as_second() + secs).expect("timestamp")
}

fn policy(min: i32, max: i32) -> Policy {
    Policy {
        min,
        max,
        target_queue_depth: 4.0,
        target_utilization: 0.8,
        stabilization: Duration::from_secs(300),
        scale_to_zero_after: Duration::from_secs(600),
    }
}

/// One recorded interval: total requests (waiting, running) over the Model and the KV use of
/// each ready pod.
#[derive(Clone, Copy, Debug)]
struct Sample {
    waiting: u64,
    running: u64,
    kv: f64,
}

fn load(waiting: u64, running: u64) -> Sample {
    Sample {
        waiting,
        running,
        kv: 0.1,
    }
}

/// A recorded series: `(seconds it lasts, sample)` segments, one sample per interval.
fn series(segments: &[(i64, Sample)]) -> Vec<Sample> {
    segments
        .iter()
        .flat_map(|(secs, s)| {
            std::iter::repeat_n(*s, usize::try_from(secs / INTERVAL).unwrap_or(0))
        })
        .collect()
}

/// The decisions and replica counts, interval by interval.
#[derive(Debug)]
struct Run {
    /// (seconds since start, replicas before the decision, decision)
    steps: Vec<(i64, i32, Decision)>,
}

impl Run {
    fn first(&self, reason: &str) -> Option<&(i64, i32, Decision)> {
        self.steps.iter().find(|(_, _, d)| d.reason == reason)
    }

    fn replicas_at(&self, secs: i64) -> i32 {
        self.steps
            .iter()
            .find(|(t, _, _)| *t == secs)
            .map(|(_, _, d)| d.desired)
            .expect("a step at that time")
    }
}

/// Feed `samples` to a fresh history starting at `start` replicas. The Deployment follows each
/// decision by the next interval; every replica is ready and reports an equal share of the
/// requests, except `silent` pods, which report nothing.
fn replay(policy: &Policy, start: i32, samples: &[Sample], silent: usize) -> Run {
    let mut history = History::default();
    let mut current = start;
    let mut steps = Vec::new();
    for (i, s) in samples.iter().enumerate() {
        let secs = i64::try_from(i).expect("small") * INTERVAL;
        let reporting = usize::try_from(current).unwrap_or(0).saturating_sub(silent);
        let pods = u64::try_from(reporting.max(1)).expect("small");
        let loads = (0..reporting)
            .map(|p| {
                let p = u64::try_from(p).expect("small");
                // Spread the remainder over the first pods, like a least-loaded router.
                let share = |total: u64| total / pods + u64::from(p < total % pods);
                PodLoad {
                    waiting: share(s.waiting),
                    running: share(s.running),
                    kv_utilization: s.kv,
                    device_utilization: None,
                }
            })
            .collect();
        let obs = Observation {
            now: at(secs),
            current,
            ready: current,
            loads,
            silent: silent.min(usize::try_from(current).unwrap_or(0)),
            scale_up_requested_at: None,
            memory_pressure: 0.0,
        };
        let d = history.decide(policy, &obs);
        steps.push((secs, current, d.clone()));
        current = d.desired;
    }
    Run { steps }
}

#[test]
fn a_burst_scales_up_within_one_interval() {
    let p = policy(1, 10);
    let samples = series(&[(60, load(0, 2)), (30, load(16, 8))]);
    let run = replay(&p, 1, &samples, 0);
    // 60 s of 2 requests: one pod is enough.
    assert!(
        run.steps[..12]
            .iter()
            .all(|(_, r, d)| *r == 1 && d.desired == 1)
    );
    // The first burst interval: 24 requests / 4 per pod = 6 pods, decided at once.
    let (t, before, d) = &run.steps[12];
    assert_eq!((*t, *before, d.desired), (60, 1, 6));
    assert_eq!(d.reason, reason::SCALED_UP_QUEUE_DEPTH);
    assert!(d.message.contains("24 requests"), "{}", d.message);
    // And it holds while the burst lasts.
    assert_eq!(run.replicas_at(85), 6);
    assert_eq!(run.first(reason::SCALED_DOWN).map(|s| s.0), None);
}

#[test]
fn a_quiet_period_scales_down_only_after_the_stabilization_window() {
    let p = policy(1, 10);
    // 5 minutes of low load first, so the autoscaler has watched a whole window.
    let samples = series(&[(300, load(0, 2)), (60, load(16, 8)), (600, load(0, 2))]);
    let run = replay(&p, 1, &samples, 0);
    let burst_end = 360;
    assert_eq!(run.replicas_at(300), 6, "the burst scales up");
    // Every decision inside the window after the last burst sample holds 6.
    for (t, before, d) in &run.steps {
        if *t > 300 && *t < burst_end - INTERVAL + 300 {
            assert_eq!((*before, d.desired), (6, 6), "at {t}s: {d:?}");
            if *t >= burst_end {
                assert_eq!(d.reason, reason::SCALE_DOWN_STABILIZING, "at {t}s");
            }
        }
    }
    let (down_at, _, first_down) = run.first(reason::SCALED_DOWN).expect("a scale-down");
    assert!(
        *down_at >= burst_end - INTERVAL + 300,
        "scaled down at {down_at}s, inside the window"
    );
    assert!(first_down.desired < 6, "{first_down:?}");
    // The smoothed recommendations leave the window one by one: down to 1 within
    // SMOOTHING_SAMPLES intervals of the first step down.
    let settle = down_at + i64::try_from(SMOOTHING_SAMPLES).expect("small") * INTERVAL;
    assert_eq!(run.replicas_at(settle), 1, "{run:#?}");
    assert!(
        run.steps
            .windows(2)
            .all(|w| w[1].1 <= w[0].1 || w[1].0 <= burst_end),
        "no scale-up after the burst"
    );
}

#[test]
fn a_restarted_autoscaler_does_not_scale_down_before_watching_a_whole_window() {
    let p = policy(1, 10);
    // The Deployment already runs 5 pods, the load is low from the first interval on.
    let run = replay(&p, 5, &series(&[(400, load(0, 1))]), 0);
    let (down_at, _, _) = run.first(reason::SCALED_DOWN).expect("a scale-down");
    assert!(*down_at >= 300, "scaled down at {down_at}s");
    assert!(
        run.steps
            .iter()
            .filter(|(t, _, _)| *t < 300)
            .all(|(_, _, d)| d.reason == reason::SCALE_DOWN_STABILIZING && d.desired == 5)
    );
}

#[test]
fn min_and_max_are_respected() {
    // Max: a burst of 100 requests wants 25 pods; 3 is the limit.
    let run = replay(&policy(1, 3), 1, &series(&[(30, load(80, 20))]), 0);
    assert_eq!(run.steps[0].2.desired, 3);
    assert_eq!(run.steps[0].2.reason, reason::SCALED_UP_QUEUE_DEPTH);
    assert!(run.steps[0].2.message.contains("capped at replicas.max 3"));
    assert!(
        run.steps[1..]
            .iter()
            .all(|(_, r, d)| *r == 3 && d.desired == 3 && d.reason == reason::AT_MAXIMUM)
    );
    // Min: an idle Model with min 2 never goes below 2, even past the window.
    let run = replay(&policy(2, 5), 2, &series(&[(900, load(0, 0))]), 0);
    assert!(
        run.steps
            .iter()
            .all(|(_, _, d)| d.desired == 2 && d.reason == reason::AT_MINIMUM)
    );
    // Bounds apply at once: max lowered below the count, min raised above it.
    let run = replay(&policy(1, 2), 6, &series(&[(5, load(40, 0))]), 0);
    assert_eq!(
        (run.steps[0].2.desired, run.steps[0].2.reason),
        (2, reason::AT_MAXIMUM)
    );
    let run = replay(&policy(4, 8), 1, &series(&[(5, load(0, 1))]), 0);
    assert_eq!(
        (run.steps[0].2.desired, run.steps[0].2.reason),
        (4, reason::AT_MINIMUM)
    );
}

#[test]
fn vram_pressure_alone_scales_up() {
    // One running request per pod (well under 4 per pod) but the KV cache 95 % full on both:
    // 1.9 summed / 0.8 per pod = 3 pods.
    let samples = series(&[(
        10,
        Sample {
            waiting: 0,
            running: 2,
            kv: 0.95,
        },
    )]);
    let run = replay(&policy(1, 10), 2, &samples, 0);
    let d = &run.steps[0].2;
    assert_eq!((d.desired, d.reason), (3, reason::SCALED_UP_VRAM_PRESSURE));
    assert!(
        d.message.contains("-> 1;"),
        "queue alone wants 1: {}",
        d.message
    );
}

#[test]
fn a_pod_whose_gpu_is_full_by_its_own_reading_counts_as_no_capacity() {
    let p = policy(1, 10);
    let pod = |running: u64, device: Option<f64>| PodLoad {
        waiting: 0,
        running,
        kv_utilization: 0.1,
        device_utilization: device,
    };
    let obs = |current: i32, loads: Vec<PodLoad>| Observation {
        now: at(0),
        current,
        ready: current,
        loads,
        silent: 0,
        scale_up_requested_at: None,
        memory_pressure: 0.0,
    };
    // One pod, one request (the queue wants 1), its GPU 95 % used by someone: one more pod.
    let d = History::default().decide(&p, &obs(1, vec![pod(1, Some(0.95))]));
    assert_eq!((d.desired, d.reason), (2, reason::SCALED_UP_VRAM_PRESSURE));
    assert!(
        d.message
            .contains("1 pods with a GPU at or above 90% used (highest 95%), counted as full -> 2"),
        "{}",
        d.message
    );
    // With the second pod (its GPU at 40 %) the count is steady: no runaway while the first
    // stays full, and no scale-down below the load plus the full pod.
    let mut h = History::default();
    for i in 0..100 {
        let mut o = obs(2, vec![pod(1, Some(0.95)), pod(0, Some(0.4))]);
        o.now = at(i * INTERVAL);
        let d = h.decide(&p, &o);
        assert_eq!(
            (d.desired, d.reason),
            (2, reason::STEADY),
            "at {}s",
            i * INTERVAL
        );
    }
    // Below the watermark, and on CPU pods (no GPU), the device term says nothing.
    for device in [Some(0.89), None] {
        let d = History::default().decide(&p, &obs(1, vec![pod(1, device)]));
        assert_eq!((d.desired, d.reason), (1, reason::STEADY), "{device:?}");
        assert!(!d.message.contains("counted as full"), "{}", d.message);
    }
    // The highest of a pod's GPUs counts, read as total minus free.
    let device = |total: u64, free: u64| gantry_api::DeviceStatus {
        index: 0,
        uuid: None,
        name: "NVIDIA H100 80GB HBM3".into(),
        compute_capability: "9.0".into(),
        total_bytes: total,
        free_bytes: free,
        utilization_percent: None,
        process_used_bytes: None,
        models: Vec::new(),
    };
    let load = PodLoad::from_queue(&QueueStatus::default()).with_devices(&[
        device(100, 60),
        device(100, 5),
        device(0, 0),
    ]);
    assert_eq!(load.device_utilization, Some(0.95));
    assert_eq!(
        PodLoad::from_queue(&QueueStatus::default())
            .with_devices(&[])
            .device_utilization,
        None
    );
}

#[test]
fn an_idle_model_scales_to_zero_with_min_0_and_not_with_min_1() {
    let samples = series(&[(60, load(0, 3)), (700, load(0, 0))]);
    let run = replay(&policy(0, 4), 1, &samples, 0);
    let (t, _, d) = run
        .first(reason::SCALED_TO_ZERO_IDLE)
        .expect("scaled to zero");
    // Idle from 60 s on: zero after exactly 600 s of idleness.
    assert_eq!((*t, d.desired), (660, 0));
    assert!(
        run.steps
            .iter()
            .filter(|(s, _, _)| *s < 660)
            .all(|(_, _, d)| d.desired == 1),
        "never below one pod before the idle period ends"
    );
    assert_eq!(run.replicas_at(755), 0, "stays at zero");

    let run = replay(&policy(1, 4), 1, &samples, 0);
    assert!(run.first(reason::SCALED_TO_ZERO_IDLE).is_none());
    assert!(run.steps.iter().all(|(_, _, d)| d.desired == 1));
}

#[test]
fn a_model_at_zero_scales_up_when_the_gateway_asks_after_the_scale_to_zero() {
    let p = policy(0, 4);
    let at_zero = |history: &mut History, secs: i64, asked: Option<i64>| {
        history.decide(
            &p,
            &Observation {
                now: at(secs),
                current: 0,
                ready: 0,
                loads: Vec::new(),
                silent: 0,
                scale_up_requested_at: asked.map(at),
                memory_pressure: 0.0,
            },
        )
    };
    // Scaled to zero at 100 s; a request recorded at 50 s is older: it stays at zero.
    let mut h = History::resume(Some(at(100)));
    let d = at_zero(&mut h, 200, Some(50));
    assert_eq!((d.desired, d.reason), (0, reason::SCALED_TO_ZERO_IDLE));
    let d = at_zero(&mut h, 205, None);
    assert_eq!((d.desired, d.reason), (0, reason::SCALED_TO_ZERO_IDLE));
    // The gateway asks at 210 s: one pod at the next interval.
    let d = at_zero(&mut h, 215, Some(210));
    assert_eq!(
        (d.desired, d.reason),
        (1, reason::SCALE_FROM_ZERO_REQUESTED)
    );
    // A Model created at min 0 that this autoscaler never scaled: any request counts.
    let mut fresh = History::default();
    let d = at_zero(&mut fresh, 5, None);
    assert_eq!((d.desired, d.reason), (0, reason::AT_MINIMUM));
    let d = at_zero(&mut fresh, 10, Some(8));
    assert_eq!(
        (d.desired, d.reason),
        (1, reason::SCALE_FROM_ZERO_REQUESTED)
    );

    // End to end: idle to zero, then a request brings one pod back.
    let mut h = History::default();
    let mut current = 1;
    let mut secs = 0;
    while current > 0 && secs < 1000 {
        let d = h.decide(
            &p,
            &Observation {
                now: at(secs),
                current,
                ready: current,
                loads: vec![PodLoad {
                    waiting: 0,
                    running: 0,
                    kv_utilization: 0.0,
                    device_utilization: None,
                }],
                silent: 0,
                scale_up_requested_at: Some(at(0)),
                memory_pressure: 0.0,
            },
        );
        current = d.desired;
        secs += INTERVAL;
    }
    assert_eq!(current, 0, "idle for 600 s");
    let d = at_zero(&mut h, secs, Some(0));
    assert_eq!(
        d.desired, 0,
        "the request from before the scale to zero is spent"
    );
    let d = at_zero(&mut h, secs + 5, Some(secs + 1));
    assert_eq!(d.desired, 1);
}

#[test]
fn missing_metrics_never_scale_down() {
    let p = policy(1, 10);
    // Four pods, low load, but one pod never answers: no scale-down, even after the window.
    let run = replay(&p, 4, &series(&[(600, load(0, 1))]), 1);
    assert!(run.steps.iter().all(|(_, _, d)| d.desired == 4), "{run:#?}");
    assert!(run.first(reason::SCALED_DOWN).is_none());
    // No pod answers at all: the count holds and the reason says why.
    let mut h = History::default();
    let d = h.decide(
        &p,
        &Observation {
            now: at(0),
            current: 3,
            ready: 3,
            loads: Vec::new(),
            silent: 3,
            scale_up_requested_at: None,
            memory_pressure: 0.0,
        },
    );
    assert_eq!((d.desired, d.reason), (3, reason::METRICS_UNAVAILABLE));
    // Silent pods never count as idle either: no scale to zero.
    let run = replay(&policy(0, 4), 2, &series(&[(900, load(0, 0))]), 1);
    assert!(run.first(reason::SCALED_TO_ZERO_IDLE).is_none());
}

#[test]
fn the_same_series_gives_the_same_decisions() {
    let samples = series(&[(120, load(0, 2)), (40, load(30, 10)), (500, load(1, 1))]);
    let a = replay(&policy(1, 8), 1, &samples, 0);
    let b = replay(&policy(1, 8), 1, &samples, 0);
    assert_eq!(
        a.steps.iter().map(|s| &s.2).collect::<Vec<_>>(),
        b.steps.iter().map(|s| &s.2).collect::<Vec<_>>()
    );
}

#[test]
fn policy_reads_the_spec_and_its_defaults() {
    let mut m = fixture_model("cpu");
    let v = validate(&m, &Settings::default()).expect("valid");
    let p = Policy::of(&v);
    assert_eq!((p.min, p.max), (1, 1));
    assert_eq!(p.target_queue_depth, 4.0);
    assert_eq!(p.target_utilization, 0.8);
    assert_eq!(p.stabilization, Duration::from_secs(300));
    assert_eq!(p.scale_to_zero_after, Duration::from_secs(600));
    m.spec.autoscaling = Some(Autoscaling {
        target_queue_depth: Some(8),
        target_vram_utilization: Some(90),
        scale_down_stabilization_seconds: Some(60),
        scale_to_zero_after_seconds: Some(120),
        ..Autoscaling::default()
    });
    let p = Policy::of(&validate(&m, &Settings::default()).expect("valid"));
    assert_eq!(p.target_queue_depth, 8.0);
    assert_eq!(p.target_utilization, 0.9);
    assert_eq!(p.stabilization, Duration::from_secs(60));
    assert_eq!(p.scale_to_zero_after, Duration::from_secs(120));
}

#[test]
fn every_reason_is_documented() {
    let doc = std::fs::read_to_string(crate::support::repo_dir().join("docs/autoscaling.md"))
        .expect("docs/autoscaling.md");
    for r in reason::ALL {
        assert!(
            doc.contains(&format!("`{r}`")),
            "docs/autoscaling.md lacks `{r}`"
        );
    }
}
