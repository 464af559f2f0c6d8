//! Model reconcile, build step (pure): how the node pods are reached — the ClusterIP Service
//! the gateway routes to, and (`--node-network-policy`) the NetworkPolicy that admits only the
//! operator, the gateway and Prometheus, and lets the pods out only to DNS and downloads.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
    NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::meta::metadata;
use crate::context::NodeNetworkPolicy;
use crate::model::validate::ValidModel;
use gantry_crd::names::{NODE_PORT, NODE_PORT_NAME, owned_name, selector_labels};

/// ClusterIP on the named port; only ready pods are endpoints, which is what the gateway routes to.
pub(super) fn service(model: &ValidModel) -> Service {
    Service {
        metadata: metadata(model, owned_name(&model.name)),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_string()),
            selector: Some(selector_labels(&model.name)),
            ports: Some(vec![ServicePort {
                name: Some(NODE_PORT_NAME.to_string()),
                port: NODE_PORT,
                target_port: Some(IntOrString::String(NODE_PORT_NAME.to_string())),
                protocol: Some("TCP".to_string()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// The label every namespace carries with its own name (set by the apiserver since 1.22).
const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";

fn namespace_peer(namespace: &str, pods: Option<&BTreeMap<String, String>>) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                LABEL_NAMESPACE_NAME.to_string(),
                namespace.to_string(),
            )])),
            ..LabelSelector::default()
        }),
        pod_selector: pods.map(|labels| LabelSelector {
            match_labels: Some(labels.clone()),
            ..LabelSelector::default()
        }),
        ..NetworkPolicyPeer::default()
    }
}

fn tcp(port: i32) -> NetworkPolicyPort {
    NetworkPolicyPort {
        port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".to_string()),
        ..NetworkPolicyPort::default()
    }
}

/// Default-deny for the node pods: ingress on the node port only from the operator and gateway
/// pods (and Prometheus, when named); egress only to DNS and TCP 443 (model downloads). The
/// kubelet's probes are not subject to NetworkPolicy.
pub(super) fn network_policy(model: &ValidModel, p: &NodeNetworkPolicy) -> NetworkPolicy {
    let mut ingress = vec![NetworkPolicyIngressRule {
        from: Some(vec![namespace_peer(
            &p.peer_namespace,
            Some(&p.peer_labels),
        )]),
        ports: Some(vec![tcp(NODE_PORT)]),
    }];
    if let Some(ns) = &p.metrics_namespace {
        ingress.push(NetworkPolicyIngressRule {
            from: Some(vec![namespace_peer(ns, None)]),
            ports: Some(vec![tcp(NODE_PORT)]),
        });
    }
    let dns = NetworkPolicyEgressRule {
        to: None,
        ports: Some(vec![
            NetworkPolicyPort {
                protocol: Some("UDP".to_string()),
                ..tcp(53)
            },
            tcp(53),
        ]),
    };
    let downloads = NetworkPolicyEgressRule {
        to: (!p.download_cidrs.is_empty()).then(|| {
            p.download_cidrs
                .iter()
                .map(|cidr| NetworkPolicyPeer {
                    ip_block: Some(IPBlock {
                        cidr: cidr.clone(),
                        except: None,
                    }),
                    ..NetworkPolicyPeer::default()
                })
                .collect()
        }),
        ports: Some(vec![tcp(443)]),
    };
    NetworkPolicy {
        metadata: metadata(model, owned_name(&model.name)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector_labels(&model.name)),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".to_string(), "Egress".to_string()]),
            ingress: Some(ingress),
            egress: Some(vec![dns, downloads]),
        }),
    }
}
