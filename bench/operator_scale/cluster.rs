//! Operator scale benchmark (outside the reconcile path), the controllers a cluster runs
//! behind the operator's objects, as stand-ins: the Deployment controller (a ReplicaSet per
//! pod template, its Pods created Pending, old ReplicaSets scaled to zero, the Deployment's
//! revision annotation and status), the scheduler's verdict on a Pod it cannot place, and the
//! kubelet starting Pods on request (Running, Ready, a pod IP). Each writes what its real
//! counterpart writes, managed fields included, and the Events it would emit, so the
//! operator's watches see objects the size and shape a real API server sends.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use serde_json::{Value, json};

use crate::apiserver::{Cluster, NOW, key_of};
use crate::fields::{set_managed, write_status};

const DEPLOYMENTS: &str = "apps/v1/deployments";
const REPLICA_SETS: &str = "apps/v1/replicasets";
const PODS: &str = "v1/pods";
const EVENTS: &str = "events.k8s.io/v1/events";
const CONTROLLER_MANAGER: &str = "kube-controller-manager";

/// `pod-template-hash` of a template: ten characters of the alphabet Kubernetes uses for
/// generated names.
fn template_hash(template: &Value) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut h = DefaultHasher::new();
    template.to_string().hash(&mut h);
    let mut n = h.finish();
    (0..10)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
            n /= ALPHABET.len() as u64;
            c
        })
        .collect()
}

/// Five characters for a generated Pod name, from a counter.
fn suffix(n: u64) -> String {
    template_hash(&json!(n))[..5].to_string()
}

fn owner_ref(obj: &Value, kind: &str) -> Value {
    json!([{"apiVersion": obj["apiVersion"], "kind": kind, "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"], "controller": true, "blockOwnerDeletion": true}])
}

fn owned_by(obj: &Value, owner: &Value) -> bool {
    obj["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| refs.iter().any(|r| r["uid"] == owner["metadata"]["uid"]))
}

/// An Event as the controller manager, the scheduler or the kubelet writes one.
fn emit(
    c: &mut Cluster,
    regarding: &Value,
    kind: &str,
    reason: &str,
    note: String,
    controller: &str,
) {
    let (ns, name) = key_of(regarding);
    let n = c.rv();
    let event = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": format!("{name}.{n:x}"), "namespace": ns},
        "eventTime": null, "reportingController": controller, "reportingInstance": "",
        "action": "", "reason": reason, "note": note, "type": "Normal",
        "regarding": {"apiVersion": regarding["apiVersion"], "kind": kind, "namespace": ns,
                      "name": name, "uid": regarding["metadata"]["uid"],
                      "resourceVersion": regarding["metadata"]["resourceVersion"]},
        "deprecatedSource": {"component": controller}, "deprecatedFirstTimestamp": NOW,
        "deprecatedLastTimestamp": NOW, "deprecatedCount": 1});
    c.upsert(EVENTS, event);
}

/// A Pod of ReplicaSet `rs` as the ReplicaSet controller creates it, with the defaults the
/// apiserver's admission adds (service account token volume, tolerations, container
/// defaults), Pending until `start_pods`.
fn new_pod(rs: &Value, n: u64) -> Value {
    let rs_name = rs["metadata"]["name"].as_str().unwrap_or_default();
    let template = &rs["spec"]["template"];
    let mut spec = template["spec"].clone();
    let token_volume = format!("kube-api-access-{}", suffix(n + 7));
    let mount = json!({"name": token_volume, "readOnly": true,
        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"});
    for list in ["initContainers", "containers"] {
        for container in spec[list].as_array_mut().into_iter().flatten() {
            if container["imagePullPolicy"].is_null() {
                container["imagePullPolicy"] = json!("IfNotPresent");
            }
            container["terminationMessagePath"] = json!("/dev/termination-log");
            container["terminationMessagePolicy"] = json!("File");
            let mounts = container["volumeMounts"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            container["volumeMounts"] = Value::Array([mounts, vec![mount.clone()]].concat());
        }
    }
    let volumes = spec["volumes"].as_array().cloned().unwrap_or_default();
    spec["volumes"] = Value::Array(
        [volumes, vec![json!({"name": token_volume, "projected": {"defaultMode": 420, "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}})]]
        .concat(),
    );
    for (k, v) in [
        ("dnsPolicy", json!("ClusterFirst")),
        ("enableServiceLinks", json!(true)),
        ("preemptionPolicy", json!("PreemptLowerPriority")),
        ("priority", json!(0)),
        ("restartPolicy", json!("Always")),
        ("schedulerName", json!("default-scheduler")),
        ("serviceAccount", json!("default")),
        ("serviceAccountName", json!("default")),
        ("terminationGracePeriodSeconds", json!(30)),
        (
            "tolerations",
            json!([{"effect": "NoExecute", "key": "node.kubernetes.io/not-ready", "operator": "Exists", "tolerationSeconds": 300},
                   {"effect": "NoExecute", "key": "node.kubernetes.io/unreachable", "operator": "Exists", "tolerationSeconds": 300}]),
        ),
    ] {
        if spec[k].is_null() {
            spec[k] = v;
        }
    }
    let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{rs_name}-{}", suffix(n)), "generateName": format!("{rs_name}-"),
            "namespace": rs["metadata"]["namespace"], "labels": template["metadata"]["labels"],
            "annotations": template["metadata"]["annotations"], "ownerReferences": owner_ref(rs, "ReplicaSet")},
        "spec": spec,
        "status": {"phase": "Pending", "qosClass": "Burstable",
            "conditions": [{"type": "PodScheduled", "status": "False", "lastProbeTime": null,
                "lastTransitionTime": NOW, "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod."}]}});
    let config = json!({"metadata": pod["metadata"], "spec": pod["spec"]});
    set_managed(&mut pod, CONTROLLER_MANAGER, "Update", None, &config);
    let status = pod["status"].take();
    write_status(&mut pod, "kube-scheduler", status);
    pod
}

/// The Deployment controller's pass over one Deployment after a write to it: the ReplicaSet
/// of its current template (created when new, scaled to `spec.replicas`), older ones scaled
/// to zero with their Pods deleted, the current one's Pods created or deleted to the count,
/// the revision annotation and the status.
pub fn sync_deployment(c: &mut Cluster, key: &(String, String)) {
    let Some(mut d) = c.get(DEPLOYMENTS, key).cloned() else {
        return;
    };
    let ns = key.0.clone();
    let replicas = d["spec"]["replicas"].as_i64().unwrap_or(1).max(0);
    let hash = template_hash(&d["spec"]["template"]);
    let rs_name = format!("{}-{hash}", key.1);
    let selector = d["spec"]["selector"]["matchLabels"].clone();
    let all_rs = c.select(REPLICA_SETS, &ns, &selector);
    let owned: Vec<Value> = all_rs.into_iter().filter(|r| owned_by(r, &d)).collect();
    // Older templates: scaled to zero, their Pods gone.
    for mut old in owned.iter().filter(|r| key_of(r).1 != rs_name).cloned() {
        if old["spec"]["replicas"] != json!(0) {
            old["spec"]["replicas"] = json!(0);
            old["status"] =
                json!({"replicas": 0, "observedGeneration": old["metadata"]["generation"]});
            c.upsert(REPLICA_SETS, old.clone());
            let mut labels = selector.clone();
            labels["pod-template-hash"] = old["metadata"]["labels"]["pod-template-hash"].clone();
            for pod in c.select(PODS, &ns, &labels) {
                c.store(PODS, pod, "DELETED");
            }
        }
    }
    let revision = owned.len() + usize::from(!owned.iter().any(|r| key_of(r).1 == rs_name));
    let mut rs = match c.get(REPLICA_SETS, &(ns.clone(), rs_name.clone())).cloned() {
        Some(rs) => rs,
        None => {
            let mut template = d["spec"]["template"].clone();
            template["metadata"]["labels"]["pod-template-hash"] = json!(hash);
            let mut match_labels = selector.clone();
            match_labels["pod-template-hash"] = json!(hash);
            let mut rs = json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": rs_name, "namespace": ns, "labels": template["metadata"]["labels"],
                    "annotations": {"deployment.kubernetes.io/desired-replicas": replicas.to_string(),
                                    "deployment.kubernetes.io/max-replicas": (replicas + 1).to_string(),
                                    "deployment.kubernetes.io/revision": revision.to_string()},
                    "ownerReferences": owner_ref(&d, "Deployment")},
                "spec": {"replicas": replicas, "selector": {"matchLabels": match_labels}, "template": template}});
            let config = rs.clone();
            set_managed(&mut rs, CONTROLLER_MANAGER, "Update", None, &config);
            let rs = c.upsert(REPLICA_SETS, rs);
            emit(
                c,
                &d,
                "Deployment",
                "ScalingReplicaSet",
                format!("Scaled up replica set {rs_name} from 0 to {replicas}"),
                "deployment-controller",
            );
            rs
        }
    };
    // The Pods of the current template, to the count.
    let mut labels = selector.clone();
    labels["pod-template-hash"] = json!(hash);
    let mut pods = c.select(PODS, &ns, &labels);
    while (pods.len() as i64) < replicas {
        let pod = new_pod(&rs, c.rv());
        let pod = c.upsert(PODS, pod);
        emit(
            c,
            &rs,
            "ReplicaSet",
            "SuccessfulCreate",
            format!("Created pod: {}", key_of(&pod).1),
            "replicaset-controller",
        );
        emit(
            c,
            &pod,
            "Pod",
            "FailedScheduling",
            pod["status"]["conditions"][0]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            "default-scheduler",
        );
        pods.push(pod);
    }
    while (pods.len() as i64) > replicas {
        if let Some(pod) = pods.pop() {
            c.store(PODS, pod, "DELETED");
        }
    }
    let ready = pods.iter().filter(|p| is_ready(p)).count() as i64;
    let rs_status = json!({"replicas": replicas, "fullyLabeledReplicas": replicas,
        "readyReplicas": ready, "availableReplicas": ready,
        "observedGeneration": rs["metadata"]["generation"]});
    if rs["spec"]["replicas"] != json!(replicas) || rs["status"] != rs_status {
        rs["spec"]["replicas"] = json!(replicas);
        write_status(&mut rs, CONTROLLER_MANAGER, rs_status);
        c.upsert(REPLICA_SETS, rs);
    }
    // The Deployment: its revision, then its status.
    if d["metadata"]["annotations"]["deployment.kubernetes.io/revision"]
        != json!(revision.to_string())
    {
        d["metadata"]["annotations"]["deployment.kubernetes.io/revision"] =
            json!(revision.to_string());
        let config = json!({"metadata": {"annotations": {"deployment.kubernetes.io/revision": revision.to_string()}}});
        set_managed(&mut d, CONTROLLER_MANAGER, "Update", None, &config);
        d = c.upsert(DEPLOYMENTS, d);
    }
    let available = ready >= replicas;
    let mut status = json!({"observedGeneration": d["metadata"]["generation"], "replicas": replicas,
        "updatedReplicas": replicas, "readyReplicas": ready, "availableReplicas": ready,
        "conditions": [
            {"type": "Available", "status": if available { "True" } else { "False" },
             "reason": if available { "MinimumReplicasAvailable" } else { "MinimumReplicasUnavailable" },
             "message": if available { "Deployment has minimum availability." } else { "Deployment does not have minimum availability." },
             "lastUpdateTime": NOW, "lastTransitionTime": NOW},
            {"type": "Progressing", "status": "True",
             "reason": if available { "NewReplicaSetAvailable" } else { "ReplicaSetUpdated" },
             "message": format!("ReplicaSet \"{rs_name}\" {}.", if available { "has successfully progressed" } else { "is progressing" }),
             "lastUpdateTime": NOW, "lastTransitionTime": NOW}]});
    if replicas > ready {
        status["unavailableReplicas"] = json!(replicas - ready);
    }
    if d["status"] != status {
        write_status(&mut d, CONTROLLER_MANAGER, status);
        c.upsert(DEPLOYMENTS, d);
    }
}

fn is_ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// The scheduler and the kubelet start every Pending node pod: bound to a node, Running,
/// Ready, with a pod IP whose `/v1/status` the benchmark answers for the pod's Model. Then
/// the Deployment controller writes each Deployment's new status.
pub fn start_pods(c: &mut Cluster) {
    let pending: Vec<Value> = c
        .collections
        .get(PODS)
        .map(|col| {
            col.objects
                .values()
                .filter(|p| p["status"]["phase"] == "Pending")
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    for mut pod in pending {
        // On loopback: the node status endpoint answers there, for the pod's Model (whose
        // served name the benchmark sets to its name).
        let model = pod["metadata"]["labels"]["gantry.dev/model"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let ip = c.nodes.add(model);
        pod["spec"]["nodeName"] = json!("gpu-node-1");
        set_managed(
            &mut pod,
            "kube-scheduler",
            "Update",
            None,
            &json!({"spec": {"nodeName": "gpu-node-1"}}),
        );
        let running = |c: &Value, init: bool| {
            let state = if init {
                json!({"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": NOW, "finishedAt": NOW,
                       "containerID": "containerd://0"}})
            } else {
                json!({"running": {"startedAt": NOW}})
            };
            json!({"name": c["name"], "image": c["image"], "imageID": format!("{}@sha256:{}", c["image"].as_str().unwrap_or_default(), "0".repeat(64)),
                   "containerID": format!("containerd://{}", "f".repeat(64)), "ready": !init, "restartCount": 0,
                   "started": !init, "lastState": {}, "state": state,
                   "volumeMounts": c["volumeMounts"].as_array().map(|ms| ms.iter().map(|m| json!({"name": m["name"], "mountPath": m["mountPath"]})).collect::<Vec<_>>())})
        };
        let containers: Vec<Value> = pod["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| running(c, false))
            .collect();
        let init: Vec<Value> = pod["spec"]["initContainers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| running(c, true))
            .collect();
        let condition = |t: &str| json!({"type": t, "status": "True", "lastProbeTime": null, "lastTransitionTime": NOW});
        let conditions: Vec<Value> = [
            "PodReadyToStartContainers",
            "Initialized",
            "Ready",
            "ContainersReady",
            "PodScheduled",
        ]
        .iter()
        .map(|t| condition(t))
        .collect();
        let status = json!({"phase": "Running", "qosClass": "Burstable", "hostIP": "10.0.0.1",
            "hostIPs": [{"ip": "10.0.0.1"}], "podIP": ip, "podIPs": [{"ip": ip}], "startTime": NOW,
            "conditions": conditions,
            "initContainerStatuses": init, "containerStatuses": containers});
        write_status(&mut pod, "kubelet", status);
        let pod = c.upsert(PODS, pod);
        emit(
            c,
            &pod,
            "Pod",
            "Started",
            "Started container node".into(),
            "kubelet",
        );
    }
    let deployments: Vec<(String, String)> = c
        .collections
        .get(DEPLOYMENTS)
        .map(|col| col.objects.keys().cloned().collect())
        .unwrap_or_default();
    for key in deployments {
        sync_deployment(c, &key);
    }
}

/// Garbage collection of a deleted Deployment: its ReplicaSets and their Pods.
pub fn collect_deployment(c: &mut Cluster, deployment: &Value) {
    let ns = key_of(deployment).0;
    let selector = deployment["spec"]["selector"]["matchLabels"].clone();
    for rs in c.select(REPLICA_SETS, &ns, &selector) {
        if !owned_by(&rs, deployment) {
            continue;
        }
        let mut labels = selector.clone();
        labels["pod-template-hash"] = rs["metadata"]["labels"]["pod-template-hash"].clone();
        for pod in c.select(PODS, &ns, &labels) {
            c.store(PODS, pod, "DELETED");
        }
        c.store(REPLICA_SETS, rs, "DELETED");
    }
}
