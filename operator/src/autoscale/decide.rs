//! Autoscaler, decide step (pure, no I/O, the time is an argument): one Model's (or pool's) replica count
//! from one interval's observation of its node pods and the recommendations it remembers.
//!
//! Per interval: `want = max(ceil(demand / targetQueueDepth), ceil(Σ KV use / target))`,
//! where demand is the waiting plus running requests of the ready pods that reported.
//! - Pools add memory pressure: evictions plus refused loads per minute per pod at or above
//!   [`PRESSURE_PER_MINUTE`] want one pod more than now.
//! - Real device memory: a pod with a GPU whose measured use (by anyone: the node, another
//!   process) is at or above [`DEVICE_WATERMARK`] of its total cannot take more load, so it
//!   does not count as capacity: `want` is at least the load-based count plus those pods. The
//!   KV term above is the part of VRAM that moves with load (engines allocate their KV cache
//!   at load, so a device's used bytes do not follow requests); this term is the part nobody
//!   asked for.
//! - Up at once: a `want` above the current count is applied in the same interval.
//! - Down only after the stabilization window: each interval's `want`, averaged over the
//!   last [`SMOOTHING_SAMPLES`], is remembered for the window; the count goes down to the
//!   highest remembered value, and only once the autoscaler has watched a whole window (the
//!   HorizontalPodAutoscaler's rule, so a restart never scales down early).
//! - Missing data never scales down: a ready pod that did not report holds the count.
//! - `[max(min, 1), max]` bounds every decision; zero is reached only by the idle rule
//!   (`min: 0`, no request for `scaleToZeroAfterSeconds`) and left only when the gateway asks.
//!
//! Every decision carries a stable reason (the constants in [`reason`]) and a message with
//! the figures behind it; docs/autoscaling.md lists them.

use std::collections::VecDeque;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::model::validate::ValidModel;

/// Evictions plus refused loads per minute per pod at which a pool wants one more pod: its
/// members' working set no longer fits in the pods it has, and the gateway sends a cold model
/// to the pod with the most room, so one more pod splits the set.
pub const PRESSURE_PER_MINUTE: f64 = 1.0;

/// Share of a GPU's memory, used by anyone, at which a pod counts as full: the node's own
/// watermark (90 %, docs/memory.md), read on the device itself rather than in the node's
/// accounting.
pub const DEVICE_WATERMARK: f64 = 0.90;

/// Recommendations averaged for the scale-down side (30 s at the default 5 s interval).
pub const SMOOTHING_SAMPLES: usize = 6;

/// Reasons of autoscaler decisions, as `status.autoscaling.reason` shows them.
pub mod reason {
    /// More replicas: the requests per pod exceed `targetQueueDepth`.
    pub const SCALED_UP_QUEUE_DEPTH: &str = "ScaledUpQueueDepth";
    /// More replicas: the KV-cache (VRAM) use per pod exceeds `targetVramUtilization`, or a
    /// pod's GPU is at or above [`super::DEVICE_WATERMARK`] of its memory by the device's own
    /// reading.
    pub const SCALED_UP_VRAM_PRESSURE: &str = "ScaledUpVramPressure";
    /// One more replica (a pool): its pods evicted models or refused loads at least
    /// [`super::PRESSURE_PER_MINUTE`] times a minute per pod.
    pub const SCALED_UP_MEMORY_PRESSURE: &str = "ScaledUpMemoryPressure";
    /// Fewer replicas would do, but the stabilization window still holds a higher recommendation.
    pub const SCALE_DOWN_STABILIZING: &str = "ScaleDownStabilizing";
    /// Fewer replicas: every recommendation in the stabilization window was lower.
    pub const SCALED_DOWN: &str = "ScaledDown";
    /// Zero replicas: no request for `scaleToZeroAfterSeconds` and `replicas.min` is 0.
    pub const SCALED_TO_ZERO_IDLE: &str = "ScaledToZeroIdle";
    /// One replica (or `min`): the gateway holds a request for a Model at zero.
    pub const SCALE_FROM_ZERO_REQUESTED: &str = "ScaleFromZeroRequested";
    /// Held at (or brought down to) `replicas.max`.
    pub const AT_MAXIMUM: &str = "AtMaximum";
    /// Held at (or brought up to) `replicas.min` (at least 1 while pods run).
    pub const AT_MINIMUM: &str = "AtMinimum";
    /// The load matches the current count.
    pub const STEADY: &str = "Steady";
    /// No ready pod reported its load: the count is held.
    pub const METRICS_UNAVAILABLE: &str = "MetricsUnavailable";
    /// `autoscaling.mode: HPA`: the HorizontalPodAutoscaler sets the replicas.
    pub const DELEGATED_TO_HPA: &str = "DelegatedToHPA";

    /// Every reason, for docs and tests.
    pub const ALL: [&str; 12] = [
        SCALED_UP_QUEUE_DEPTH,
        SCALED_UP_VRAM_PRESSURE,
        SCALED_UP_MEMORY_PRESSURE,
        SCALE_DOWN_STABILIZING,
        SCALED_DOWN,
        SCALED_TO_ZERO_IDLE,
        SCALE_FROM_ZERO_REQUESTED,
        AT_MAXIMUM,
        AT_MINIMUM,
        STEADY,
        METRICS_UNAVAILABLE,
        DELEGATED_TO_HPA,
    ];
}

/// A Model's scaling rules, from its validated spec.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    pub min: i32,
    pub max: i32,
    /// Requests (waiting + running) per pod to aim for; > 0.
    pub target_queue_depth: f64,
    /// KV-cache use per pod to aim for, as a fraction in (0, 1].
    pub target_utilization: f64,
    pub stabilization: Duration,
    pub scale_to_zero_after: Duration,
}

impl Policy {
    pub fn of(model: &ValidModel) -> Policy {
        let a = &model.autoscaling;
        let secs = |s: i32| Duration::from_secs(u64::try_from(s).unwrap_or(0));
        Policy {
            min: model.replicas.min,
            max: model.replicas.max,
            target_queue_depth: f64::from(a.target_queue_depth.max(1)),
            target_utilization: f64::from(a.target_vram_utilization.clamp(1, 100)) / 100.0,
            stabilization: secs(a.scale_down_stabilization_seconds),
            scale_to_zero_after: secs(a.scale_to_zero_after_seconds),
        }
    }

    /// The lowest count while pods run.
    fn floor(&self) -> i32 {
        self.min.max(1)
    }
}

/// What one ready node pod reported for the Model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PodLoad {
    pub waiting: u64,
    pub running: u64,
    /// KV-cache cells in use, 0-1.
    pub kv_utilization: f64,
    /// The highest used share (total minus free, whoever holds it) among the pod's GPUs, 0-1;
    /// `None` for a pod without a GPU.
    pub device_utilization: Option<f64>,
}

impl PodLoad {
    /// From the node's status document: `kvUsedTokens / kvCapacityTokens` (0 while unknown).
    pub fn from_queue(q: &gantry_api::QueueStatus) -> PodLoad {
        let kv_utilization = if q.kv_capacity_tokens == 0 {
            0.0
        } else {
            (q.kv_used_tokens as f64 / q.kv_capacity_tokens as f64).clamp(0.0, 1.0)
        };
        PodLoad {
            waiting: q.waiting,
            running: q.running,
            kv_utilization,
            device_utilization: None,
        }
    }

    /// With the devices the node reports (`/v1/status` `devices`, read from the driver).
    pub fn with_devices(self, devices: &[gantry_api::DeviceStatus]) -> PodLoad {
        let device_utilization = devices
            .iter()
            .filter(|d| d.total_bytes > 0)
            .map(|d| d.total_bytes.saturating_sub(d.free_bytes) as f64 / d.total_bytes as f64)
            .reduce(f64::max)
            .map(|u| u.clamp(0.0, 1.0));
        PodLoad {
            device_utilization,
            ..self
        }
    }

    /// Whether a GPU of this pod is at or above [`DEVICE_WATERMARK`].
    fn device_full(&self) -> bool {
        self.device_utilization
            .is_some_and(|u| u >= DEVICE_WATERMARK)
    }
}

/// One interval's view of a Model.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    pub now: Timestamp,
    /// The Deployment's `spec.replicas`.
    pub current: i32,
    /// Ready node pods.
    pub ready: i32,
    /// Loads of the ready pods that answered.
    pub loads: Vec<PodLoad>,
    /// Ready pods that did not answer (unreachable, error, no entry for the model).
    pub silent: usize,
    /// The gateway's `gantry.dev/scale-up-requested-at`, when set and valid.
    pub scale_up_requested_at: Option<Timestamp>,
    /// Models evicted plus loads refused per minute, summed over the reporting pods, since the
    /// previous interval (pools; 0 for a Model).
    pub memory_pressure: f64,
}

/// What the autoscaler wants, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub desired: i32,
    pub reason: &'static str,
    pub message: String,
}

/// What one Model's autoscaler remembers between intervals (in memory, on the leader).
#[derive(Clone, Debug, Default)]
pub struct History {
    /// The last [`SMOOTHING_SAMPLES`] recommendations.
    recent: VecDeque<i32>,
    /// Smoothed recommendations inside the stabilization window, oldest first.
    window: VecDeque<(Timestamp, i32)>,
    /// First observation with pods running: no scale-down before a whole window has passed.
    observing_since: Option<Timestamp>,
    /// Start of the current run of intervals without any request.
    idle_since: Option<Timestamp>,
    /// When this autoscaler last scaled the Model to zero.
    zero_since: Option<Timestamp>,
}

fn millis_between(earlier: Timestamp, later: Timestamp) -> i64 {
    later.as_millisecond() - earlier.as_millisecond()
}

fn at_least(earlier: Timestamp, later: Timestamp, span: Duration) -> bool {
    millis_between(earlier, later) >= i64::try_from(span.as_millis()).unwrap_or(i64::MAX)
}

fn ceil_div(x: f64, target: f64) -> i32 {
    let v = (x / target - 1e-9).ceil();
    if v.is_finite() && v > 0.0 {
        v.min(f64::from(i32::MAX)) as i32
    } else {
        0
    }
}

impl History {
    /// A history for a Model first seen at zero replicas: `zero_since` is when it got there,
    /// as the last status recorded (a gateway request older than that is not a new one).
    pub fn resume(zero_since: Option<Timestamp>) -> History {
        History {
            zero_since,
            ..History::default()
        }
    }

    fn forget_load(&mut self) {
        self.recent.clear();
        self.window.clear();
        self.observing_since = None;
        self.idle_since = None;
    }

    /// Decide one interval. Deterministic: the same history and observation give the same
    /// decision.
    pub fn decide(&mut self, policy: &Policy, obs: &Observation) -> Decision {
        let floor = policy.floor().min(policy.max);
        if obs.current <= 0 {
            return self.at_zero(policy, obs, floor);
        }
        let now = obs.now;
        let observing_since = *self.observing_since.get_or_insert(now);
        let current = obs.current;

        let decision = if obs.loads.is_empty() {
            self.idle_since = None;
            Decision {
                desired: current,
                reason: reason::METRICS_UNAVAILABLE,
                message: format!(
                    "no load reported ({} of {current} node pods ready, {} silent); holding {current}",
                    obs.ready, obs.silent
                ),
            }
        } else {
            let waiting: u64 = obs.loads.iter().map(|l| l.waiting).sum();
            let running: u64 = obs.loads.iter().map(|l| l.running).sum();
            let demand = waiting.saturating_add(running);
            let kv: f64 = obs.loads.iter().map(|l| l.kv_utilization).sum();
            let by_queue = ceil_div(demand as f64, policy.target_queue_depth);
            let by_kv = ceil_div(kv, policy.target_utilization);
            let pods = obs.loads.len().max(1) as f64;
            let pressured = obs.memory_pressure / pods >= PRESSURE_PER_MINUTE;
            let by_pressure = if pressured { current + 1 } else { 0 };
            // Full pods take no more load: the load-based count, plus them.
            let full = obs.loads.iter().filter(|l| l.device_full()).count();
            let full = i32::try_from(full).unwrap_or(i32::MAX);
            let by_device = if full > 0 {
                by_queue.max(by_kv).max(1).saturating_add(full)
            } else {
                0
            };
            let want = by_queue.max(by_kv).max(by_pressure).max(by_device);
            let partial = obs.silent > 0;
            let figures = format!(
                "{demand} requests ({waiting} waiting, {running} running) on {} reporting pods, target {} per pod -> {by_queue}; KV use {:.0}% summed, target {:.0}% per pod -> {by_kv}{}",
                obs.loads.len(),
                policy.target_queue_depth,
                kv * 100.0,
                policy.target_utilization * 100.0,
                if partial {
                    format!("; {} ready pods silent", obs.silent)
                } else {
                    String::new()
                }
            ) + &if obs.memory_pressure > 0.0 {
                format!(
                    "; memory pressure {:.1} evictions and refused loads per minute, target under {PRESSURE_PER_MINUTE} per pod -> {by_pressure}",
                    obs.memory_pressure
                )
            } else {
                String::new()
            } + &if full > 0 {
                let highest = obs
                    .loads
                    .iter()
                    .filter_map(|l| l.device_utilization)
                    .fold(0.0, f64::max);
                format!(
                    "; {full} pods with a GPU at or above {:.0}% used (highest {:.0}%), counted as full -> {by_device}",
                    DEVICE_WATERMARK * 100.0,
                    highest * 100.0
                )
            } else {
                String::new()
            };

            // A silent pod's load is unknown: remember at least the current count, so missing
            // data never lets the window fall.
            let remembered = if partial { want.max(current) } else { want };
            self.recent.push_back(remembered);
            while self.recent.len() > SMOOTHING_SAMPLES {
                self.recent.pop_front();
            }
            let sum: i64 = self.recent.iter().map(|v| i64::from(*v)).sum();
            let n = i64::try_from(self.recent.len()).unwrap_or(1).max(1);
            let smoothed = i32::try_from((sum + n - 1) / n).unwrap_or(i32::MAX);
            self.window.push_back((now, smoothed));
            let span = i64::try_from(policy.stabilization.as_millis()).unwrap_or(i64::MAX);
            while self
                .window
                .front()
                .is_some_and(|(t, _)| millis_between(*t, now) > span)
            {
                self.window.pop_front();
            }

            if demand == 0 && !partial {
                self.idle_since.get_or_insert(now);
            } else {
                self.idle_since = None;
            }
            if policy.min == 0
                && self
                    .idle_since
                    .is_some_and(|t| at_least(t, now, policy.scale_to_zero_after))
            {
                self.forget_load();
                self.zero_since = Some(now);
                return Decision {
                    desired: 0,
                    reason: reason::SCALED_TO_ZERO_IDLE,
                    message: format!(
                        "no request for {}s (scaleToZeroAfterSeconds) and replicas.min is 0",
                        policy.scale_to_zero_after.as_secs()
                    ),
                };
            }

            if want > current {
                if current >= policy.max {
                    Decision {
                        desired: policy.max,
                        reason: reason::AT_MAXIMUM,
                        message: format!("wants {want}, replicas.max is {}: {figures}", policy.max),
                    }
                } else {
                    let desired = want.min(policy.max);
                    let capped = if want > policy.max {
                        format!(" (capped at replicas.max {})", policy.max)
                    } else {
                        String::new()
                    };
                    Decision {
                        desired,
                        reason: if by_pressure > by_queue.max(by_kv).max(by_device) {
                            reason::SCALED_UP_MEMORY_PRESSURE
                        } else if by_device > by_queue.max(by_kv) {
                            reason::SCALED_UP_VRAM_PRESSURE
                        } else if by_queue >= by_kv {
                            reason::SCALED_UP_QUEUE_DEPTH
                        } else {
                            reason::SCALED_UP_VRAM_PRESSURE
                        },
                        message: format!("{current} -> {desired}{capped}: {figures}"),
                    }
                }
            } else if want < current {
                let highest = self.window.iter().map(|(_, v)| *v).max().unwrap_or(current);
                let target = highest.clamp(floor, policy.max);
                let watched = at_least(observing_since, now, policy.stabilization);
                if current <= floor {
                    Decision {
                        desired: current,
                        reason: reason::AT_MINIMUM,
                        message: format!("wants {want}, replicas.min is {}: {figures}", policy.min),
                    }
                } else if watched && target < current {
                    Decision {
                        desired: target,
                        reason: reason::SCALED_DOWN,
                        message: format!(
                            "{current} -> {target}, the highest recommendation in the last {}s: {figures}",
                            policy.stabilization.as_secs()
                        ),
                    }
                } else {
                    Decision {
                        desired: current,
                        reason: reason::SCALE_DOWN_STABILIZING,
                        message: format!(
                            "wants {want}; the last {}s recommend up to {} (watched for {}s); holding {current}: {figures}",
                            policy.stabilization.as_secs(),
                            highest.max(current),
                            millis_between(observing_since, now).max(0) / 1000
                        ),
                    }
                }
            } else {
                Decision {
                    desired: current,
                    reason: reason::STEADY,
                    message: figures,
                }
            }
        };

        // The bounds apply at once, whatever the load says.
        if current > policy.max {
            Decision {
                desired: policy.max,
                reason: reason::AT_MAXIMUM,
                message: format!(
                    "{current} -> {}: replicas.max is {}",
                    policy.max, policy.max
                ),
            }
        } else if decision.desired < floor {
            Decision {
                desired: floor,
                reason: reason::AT_MINIMUM,
                message: format!("{current} -> {floor}: replicas.min is {}", policy.min),
            }
        } else {
            decision
        }
    }

    /// No replica runs: stay there until `min` rises or the gateway asks for one.
    fn at_zero(&mut self, policy: &Policy, obs: &Observation, floor: i32) -> Decision {
        self.forget_load();
        if policy.min > 0 {
            return Decision {
                desired: floor,
                reason: reason::AT_MINIMUM,
                message: format!("0 -> {floor}: replicas.min is {}", policy.min),
            };
        }
        // A request newer than the last scale to zero (any request, when this autoscaler
        // never scaled the Model to zero: it was created at min 0 or the leader changed).
        let asked = match (obs.scale_up_requested_at, self.zero_since) {
            (Some(asked), Some(zero)) => asked > zero,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if asked {
            let at = obs
                .scale_up_requested_at
                .map(|t| t.to_string())
                .unwrap_or_default();
            return Decision {
                desired: floor,
                reason: reason::SCALE_FROM_ZERO_REQUESTED,
                message: format!("0 -> {floor}: the gateway holds a request (asked at {at})"),
            };
        }
        match self.zero_since {
            Some(since) => Decision {
                desired: 0,
                reason: reason::SCALED_TO_ZERO_IDLE,
                message: format!(
                    "scaled to zero at {since}; the gateway's next request starts a node pod"
                ),
            },
            None => Decision {
                desired: 0,
                reason: reason::AT_MINIMUM,
                message: "replicas.min is 0; the gateway's first request starts a node pod"
                    .to_string(),
            },
        }
    }
}
