//! Model reconcile, build step (pure): how many node pods run and how they may go — the
//! Deployment's first replica count, the HorizontalPodAutoscaler of `autoscaling.mode: HPA`
//! and the PodDisruptionBudget of a Model with `replicas.min > 1`.

use std::collections::BTreeMap;

use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, HPAScalingRules, HorizontalPodAutoscaler,
    HorizontalPodAutoscalerBehavior, HorizontalPodAutoscalerSpec, MetricIdentifier, MetricSpec,
    MetricTarget, PodsMetricSource,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::meta::metadata;
use crate::model::validate::ValidModel;
use gantry_crd::AutoscalingMode;
use gantry_crd::names::{owned_name, selector_labels};

/// Replicas of a new Deployment: `replicas.min` (at least 1 for an HPA, which cannot start
/// from zero).
pub fn initial_replicas(model: &ValidModel) -> i32 {
    match model.autoscaling.mode {
        AutoscalingMode::Builtin => model.replicas.min,
        AutoscalingMode::Hpa => model.replicas.min.max(1),
    }
}

/// Metric names the HPA reads through a metrics adapter: the node's own gauges, per pod.
pub const HPA_METRIC_WAITING: &str = "gantry_num_requests_waiting";
pub const HPA_METRIC_KV_USAGE: &str = "gantry_kv_cache_usage_perc";

/// `autoscaling/v2` HPA on the node pods' waiting requests and KV-cache usage. The node
/// exports KV usage as a fraction (0-1), so the percent target becomes a milli-quantity
/// (80 % → `800m`). Both metrics are selected by the node's `model` label, which is the
/// served name.
pub(super) fn hpa(model: &ValidModel) -> HorizontalPodAutoscaler {
    let a = &model.autoscaling;
    let pods_metric = |name: &str, target: Quantity| MetricSpec {
        type_: "Pods".to_string(),
        pods: Some(PodsMetricSource {
            metric: MetricIdentifier {
                name: name.to_string(),
                selector: Some(LabelSelector {
                    match_labels: Some(BTreeMap::from([(
                        "model".to_string(),
                        model.served_name.clone(),
                    )])),
                    ..LabelSelector::default()
                }),
            },
            target: MetricTarget {
                type_: "AverageValue".to_string(),
                average_value: Some(target),
                ..MetricTarget::default()
            },
        }),
        ..MetricSpec::default()
    };
    HorizontalPodAutoscaler {
        metadata: metadata(model, owned_name(&model.name)),
        spec: HorizontalPodAutoscalerSpec {
            scale_target_ref: CrossVersionObjectReference {
                api_version: Some("apps/v1".to_string()),
                kind: "Deployment".to_string(),
                name: owned_name(&model.name),
            },
            // Validation refuses min 0 in HPA mode; max(1) keeps the object valid regardless.
            min_replicas: Some(model.replicas.min.max(1)),
            max_replicas: model.replicas.max,
            metrics: Some(vec![
                pods_metric(
                    HPA_METRIC_WAITING,
                    Quantity(a.target_queue_depth.to_string()),
                ),
                pods_metric(
                    HPA_METRIC_KV_USAGE,
                    Quantity(format!("{}m", a.target_vram_utilization * 10)),
                ),
            ]),
            behavior: Some(HorizontalPodAutoscalerBehavior {
                scale_down: Some(HPAScalingRules {
                    stabilization_window_seconds: Some(a.scale_down_stabilization_seconds),
                    ..HPAScalingRules::default()
                }),
                // Scale up at once, as the built-in autoscaler does.
                scale_up: Some(HPAScalingRules {
                    stabilization_window_seconds: Some(0),
                    ..HPAScalingRules::default()
                }),
            }),
        },
        ..HorizontalPodAutoscaler::default()
    }
}

pub(super) fn pdb(model: &ValidModel) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: metadata(model, owned_name(&model.name)),
        spec: Some(PodDisruptionBudgetSpec {
            // One node pod at a time: voluntary disruptions never take more than one
            // replica of a model away.
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&model.name)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        ..PodDisruptionBudget::default()
    }
}
