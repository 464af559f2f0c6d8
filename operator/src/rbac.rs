//! Permissions (outside the reconcile path, beside every step that calls the API): the one table
//! of Kubernetes API rules the operator's components need.
//!
//! The Helm chart's ClusterRoles and Roles are checked against this table
//! (`tests/python/test_chart.py` renders the chart and compares its rules with
//! `gantry-operator rbac`), and the operator's mock-API tests check every
//! request the code makes against it (`operator/tests/operator/support.rs`).
//! So a new API call without a row here fails a test, and a row the chart does
//! not grant fails another. docs/security.md prints the same table.

use serde::Serialize;

/// Which process needs the rule. The chart binds each component's rules to the ServiceAccount
/// of the pods that run it (one account when both run in one pod).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Component {
    /// Model and EnginePlugin reconcilers, leader election and the autoscaler.
    Controller,
    /// The OpenAI-compatible gateway (active-active, no leader election).
    Gateway,
}

/// Where the rule applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Scope {
    /// Every namespace (a ClusterRole): Models live in any namespace and EnginePlugins are
    /// cluster-scoped, so the objects they own and the pods that serve them are everywhere.
    Cluster,
    /// Only the operator's own namespace (a Role): the leader Lease and the API-key Secret.
    OperatorNamespace,
}

/// Which object names the rule is limited to (RBAC `resourceNames`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Names {
    /// Any object of the resource.
    Any,
    /// Only the leader Lease (`--lease-name`, default [`LEASE_NAME`]).
    LeaderLease,
    /// Only the gateway's API-key Secret (`--api-keys-secret`).
    ApiKeysSecret,
}

/// The default name of the leader Lease (`gantry-operator run --lease-name`).
pub const LEASE_NAME: &str = "gantry-operator";

/// One RBAC rule: `verbs` on `group`/`resource` for `component`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    pub component: Component,
    pub scope: Scope,
    /// API group; `""` is the core group.
    pub group: &'static str,
    /// Plural resource, with `/subresource` where one is used.
    pub resource: &'static str,
    pub names: Names,
    pub verbs: &'static [&'static str],
    /// Which code needs it, for the docs and for a reviewer.
    pub why: &'static str,
}

const fn rule(
    component: Component,
    scope: Scope,
    group: &'static str,
    resource: &'static str,
    names: Names,
    verbs: &'static [&'static str],
    why: &'static str,
) -> Rule {
    Rule {
        component,
        scope,
        group,
        resource,
        names,
        verbs,
        why,
    }
}

use Component::{Controller, Gateway};
use Names::{Any, ApiKeysSecret, LeaderLease};
use Scope::{Cluster, OperatorNamespace};

/// Read and watch.
const READ: &[&str] = &["get", "list", "watch"];
/// Owned objects: read, watch (`Controller::owns`), server-side apply (which is a `patch`
/// that the apiserver also authorizes as `create` when the object does not exist yet), delete.
const OWNED: &[&str] = &["create", "delete", "get", "list", "patch", "watch"];

/// Every rule the operator needs, grouped by component. Verbs are sorted; the chart must grant
/// exactly these (no more, no less).
pub const RULES: &[Rule] = &[
    // --- controller ------------------------------------------------------------------------
    rule(
        Controller,
        Cluster,
        "gantry.dev",
        "models",
        Any,
        READ,
        "Model reconcile: watch every Model (cluster-wide reflector)",
    ),
    rule(
        Controller,
        Cluster,
        "gantry.dev",
        "models/status",
        Any,
        &["patch"],
        "Model status step and autoscaler: server-side apply of status",
    ),
    rule(
        Controller,
        Cluster,
        "gantry.dev",
        "modelpools",
        Any,
        READ,
        "ModelPool reconcile: watch every ModelPool (cluster-wide reflector)",
    ),
    rule(
        Controller,
        Cluster,
        "gantry.dev",
        "modelpools/status",
        Any,
        &["patch"],
        "ModelPool status step: server-side apply of status",
    ),
    rule(
        Controller,
        Cluster,
        "gantry.dev",
        "engineplugins",
        Any,
        READ,
        "EnginePlugin reconcile and engine selection (cluster-scoped objects)",
    ),
    rule(
        Controller,
        Cluster,
        "gantry.dev",
        "engineplugins/status",
        Any,
        &["patch"],
        "EnginePlugin status step: server-side apply of status",
    ),
    rule(
        Controller,
        Cluster,
        "",
        "configmaps",
        Any,
        &["create", "get", "list", "patch", "watch"],
        "Model apply step: the node config ConfigMap (owned, never deleted by the operator)",
    ),
    rule(
        Controller,
        Cluster,
        "",
        "services",
        Any,
        &["create", "get", "list", "patch", "watch"],
        "Model apply step: the node pods' Service (owned, never deleted by the operator)",
    ),
    rule(
        Controller,
        Cluster,
        "",
        "persistentvolumeclaims",
        Any,
        &["create", "get", "list", "patch", "watch"],
        "Model apply step: the cache claim (kept until the Model goes)",
    ),
    rule(
        Controller,
        Cluster,
        "apps",
        "deployments",
        Any,
        OWNED,
        "Model apply step: node pods; the autoscaler applies spec.replicas as gantry-autoscaler",
    ),
    rule(
        Controller,
        Cluster,
        "policy",
        "poddisruptionbudgets",
        Any,
        OWNED,
        "Model apply step: PDB when replicas.min > 1, removed below that",
    ),
    rule(
        Controller,
        Cluster,
        "autoscaling",
        "horizontalpodautoscalers",
        Any,
        &["create", "delete", "get", "list", "patch", "watch"],
        "autoscaler HPA mode: the Model's autoscaling/v2 HPA",
    ),
    rule(
        Controller,
        Cluster,
        "",
        "secrets",
        Any,
        &["create", "get", "patch"],
        "Model apply step: the Model's node-token Secret (owned; never listed or watched). \
         No new reach: creating Deployments in a namespace already lets a pod mount its Secrets",
    ),
    rule(
        Controller,
        Cluster,
        "networking.k8s.io",
        "networkpolicies",
        Any,
        &["create", "get", "list", "patch", "watch"],
        "Model apply step: the node pods' NetworkPolicy (owned, with --node-network-policy; \
         cached by a label-selected metadata watch)",
    ),
    rule(
        Controller,
        Cluster,
        "",
        "pods",
        Any,
        &["list", "watch"],
        "node pod cache (label-selected watch): Model and EnginePlugin read steps, report \
         poller, autoscaler",
    ),
    rule(
        Controller,
        Cluster,
        "",
        "pods/ephemeralcontainers",
        Any,
        &["patch"],
        "Model deliver step: a plugin copy container added to a running node pod (in-place \
         plugin update; off with --plugin-delivery rollout)",
    ),
    rule(
        Controller,
        Cluster,
        "events.k8s.io",
        "events",
        Any,
        &["create", "patch"],
        "Events on Models and EnginePlugins (kube Recorder patches repeats)",
    ),
    rule(
        Controller,
        OperatorNamespace,
        "coordination.k8s.io",
        "leases",
        Any,
        &["create"],
        "leader election: create the Lease (create cannot be limited by name)",
    ),
    rule(
        Controller,
        OperatorNamespace,
        "coordination.k8s.io",
        "leases",
        LeaderLease,
        &["get", "update"],
        "leader election: read, renew, take over and release the Lease",
    ),
    // --- gateway ---------------------------------------------------------------------------
    rule(
        Gateway,
        Cluster,
        "gantry.dev",
        "models",
        Any,
        READ,
        "gateway: route by servedName to the Model's Service",
    ),
    rule(
        Gateway,
        Cluster,
        "discovery.k8s.io",
        "endpointslices",
        Any,
        &["list", "watch"],
        "gateway: the ready node pods of each Model",
    ),
    rule(
        Gateway,
        Cluster,
        "apps",
        "deployments",
        Any,
        &["patch"],
        "gateway: scale-from-zero annotation on a Model's Deployment",
    ),
    rule(
        Gateway,
        OperatorNamespace,
        "",
        "secrets",
        ApiKeysSecret,
        &["get"],
        "gateway: API keys (only the named Secret)",
    ),
];

/// Whether `component` may do `verb` on `group`/`resource` in `scope`, to an object named
/// `name` (`None` for collection requests: list, watch, create). A rule limited to names never
/// covers a collection request, as in Kubernetes RBAC.
pub fn allows(
    component: Component,
    scope: Scope,
    group: &str,
    resource: &str,
    verb: &str,
    name: Option<&str>,
    names_of: impl Fn(Names) -> Option<String>,
) -> bool {
    RULES.iter().any(|r| {
        r.component == component
            && (r.scope == scope || r.scope == Scope::Cluster)
            && r.group == group
            && r.resource == resource
            && r.verbs.contains(&verb)
            && match r.names {
                Names::Any => true,
                limited => name.is_some() && name.map(str::to_string) == names_of(limited),
            }
    })
}

/// The table as JSON, for the chart test and `gantry-operator rbac`.
pub fn to_json() -> serde_json::Value {
    serde_json::json!({ "leaseName": LEASE_NAME, "rules": RULES })
}

/// The table as a Markdown table, for docs/security.md.
pub fn to_markdown() -> String {
    let mut out = String::from(
        "| component | scope | apiGroup | resource | names | verbs | why |\n|---|---|---|---|---|---|---|\n",
    );
    for r in RULES {
        let scope = match r.scope {
            Scope::Cluster => "cluster (ClusterRole)",
            Scope::OperatorNamespace => "operator namespace (Role)",
        };
        let names = match r.names {
            Names::Any => "any",
            Names::LeaderLease => "the leader Lease",
            Names::ApiKeysSecret => "the API-key Secret",
        };
        let group = if r.group.is_empty() {
            "\"\" (core)"
        } else {
            r.group
        };
        let component = match r.component {
            Component::Controller => "controller",
            Component::Gateway => "gateway",
        };
        out.push_str(&format!(
            "| {component} | {scope} | `{group}` | `{}` | {names} | {} | {} |\n",
            r.resource,
            r.verbs.join(", "),
            r.why
        ));
    }
    out
}
