//! Model reconcile, validate step (pure): `spec.autoscaling` and `spec.rollout` with their
//! defaults filled in, re-checked against the ranges and rules the CRD's schema and CEL rules
//! state (an installed CRD may be older than this operator).

use super::invalid::Invalid;
use gantry_crd::{Autoscaling, AutoscalingMode, Replicas, Rollout, RolloutStrategy};

/// `spec.autoscaling` with every default filled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValidAutoscaling {
    pub mode: AutoscalingMode,
    /// Requests per node pod to aim for.
    pub target_queue_depth: i32,
    /// KV-cache (VRAM) utilization per node pod to aim for, in percent.
    pub target_vram_utilization: i32,
    pub scale_down_stabilization_seconds: i32,
    pub scale_to_zero_after_seconds: i32,
}

/// `spec.rollout` as the Deployment's RollingUpdate: exactly one of the two is non-zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValidRollout {
    pub strategy: RolloutStrategy,
    pub max_surge: i32,
    pub max_unavailable: i32,
}

impl Default for ValidRollout {
    /// `Surge` by one pod: no downtime, whatever the replica count.
    fn default() -> Self {
        ValidRollout {
            strategy: RolloutStrategy::Surge,
            max_surge: 1,
            max_unavailable: 0,
        }
    }
}

/// Fill the rollout defaults and re-check what the CRD's schema and CEL rules state: each knob
/// belongs to one strategy, and is between 1 and 100.
pub(super) fn validate_rollout(
    spec: Option<&Rollout>,
    problems: &mut Vec<Invalid>,
) -> ValidRollout {
    let Some(r) = spec else {
        return ValidRollout::default();
    };
    let mut knob = |name: &'static str, value: Option<i32>| {
        let v = value.unwrap_or(1);
        if !(1..=100).contains(&v) {
            problems.push(Invalid::new(
                name,
                format!("must be between 1 and 100, got {v}"),
            ));
        }
        v
    };
    let (surge, unavailable) = (
        knob("spec.rollout.maxSurge", r.max_surge),
        knob("spec.rollout.maxUnavailable", r.max_unavailable),
    );
    match r.strategy {
        RolloutStrategy::Surge => {
            if r.max_unavailable.is_some() {
                problems.push(Invalid::new(
                    "spec.rollout.maxUnavailable",
                    "applies only to strategy InPlace (Surge never removes a pod before its replacement is ready)",
                ));
            }
            ValidRollout {
                strategy: r.strategy,
                max_surge: surge,
                max_unavailable: 0,
            }
        }
        RolloutStrategy::InPlace => {
            if r.max_surge.is_some() {
                problems.push(Invalid::new(
                    "spec.rollout.maxSurge",
                    "applies only to strategy Surge (InPlace never starts a pod above the count)",
                ));
            }
            ValidRollout {
                strategy: r.strategy,
                max_surge: 0,
                max_unavailable: unavailable,
            }
        }
    }
}

/// Defaults of `spec.autoscaling` (docs/autoscaling.md lists them).
pub const DEFAULT_TARGET_QUEUE_DEPTH: i32 = 4;
pub const DEFAULT_TARGET_VRAM_UTILIZATION: i32 = 80;
pub const DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS: i32 = 300;
pub const DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS: i32 = 600;

impl Default for ValidAutoscaling {
    fn default() -> Self {
        ValidAutoscaling {
            mode: AutoscalingMode::Builtin,
            target_queue_depth: DEFAULT_TARGET_QUEUE_DEPTH,
            target_vram_utilization: DEFAULT_TARGET_VRAM_UTILIZATION,
            scale_down_stabilization_seconds: DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS,
            scale_to_zero_after_seconds: DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS,
        }
    }
}

/// Fill the autoscaling defaults and re-check the ranges the CRD schema states.
pub(super) fn validate_autoscaling(
    spec: Option<&Autoscaling>,
    replicas: &Replicas,
    problems: &mut Vec<Invalid>,
) -> ValidAutoscaling {
    let d = ValidAutoscaling::default();
    let Some(a) = spec else { return d };
    let mut field = |name: &'static str, value: Option<i32>, lo: i32, hi: i32, default: i32| {
        let v = value.unwrap_or(default);
        if !(lo..=hi).contains(&v) {
            problems.push(Invalid::new(
                name,
                format!("must be between {lo} and {hi}, got {v}"),
            ));
        }
        v
    };
    let out = ValidAutoscaling {
        mode: a.mode,
        target_queue_depth: field(
            "spec.autoscaling.targetQueueDepth",
            a.target_queue_depth,
            1,
            10000,
            d.target_queue_depth,
        ),
        target_vram_utilization: field(
            "spec.autoscaling.targetVramUtilization",
            a.target_vram_utilization,
            1,
            100,
            d.target_vram_utilization,
        ),
        scale_down_stabilization_seconds: field(
            "spec.autoscaling.scaleDownStabilizationSeconds",
            a.scale_down_stabilization_seconds,
            0,
            3600,
            d.scale_down_stabilization_seconds,
        ),
        scale_to_zero_after_seconds: field(
            "spec.autoscaling.scaleToZeroAfterSeconds",
            a.scale_to_zero_after_seconds,
            0,
            86400,
            d.scale_to_zero_after_seconds,
        ),
    };
    // `minReplicas: 0` needs the alpha HPAScaleToZero gate; refusing is clearer than a silent 1.
    if a.mode == AutoscalingMode::Hpa && replicas.min < 1 {
        problems.push(Invalid::new(
            "spec.replicas.min",
            format!(
                "must be >= 1 with autoscaling.mode HPA (a HorizontalPodAutoscaler cannot scale to zero; use mode Builtin for min 0), got {}",
                replicas.min
            ),
        ));
    }
    out
}
