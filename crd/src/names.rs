//! Shared names (every reconcile step, and the gateway's discovery and scale-up request): the
//! field manager, label and annotation keys, and how owned objects are named.
//!
//! Keeping them in one module means the build step, the read step, the gateway and the
//! tests cannot disagree about a selector or an annotation key.

/// The one field manager for every server-side apply, object and status alike.
pub const FIELD_MANAGER: &str = "gantry-operator";
/// The field manager of the built-in autoscaler. It owns exactly two things: the node
/// Deployment's `spec.replicas` and the Model's `status.autoscaling`. Keeping it apart from
/// [`FIELD_MANAGER`] is what stops the reconciler's apply from resetting the replica count.
pub const AUTOSCALER_FIELD_MANAGER: &str = "gantry-autoscaler";

/// API group and version of both custom resources.
pub const API_GROUP: &str = "gantry.dev";
pub const API_VERSION: &str = "v1alpha1";

/// Recommended Kubernetes labels on every owned object and node pod.
pub const LABEL_NAME: &str = "app.kubernetes.io/name";
pub const LABEL_INSTANCE: &str = "app.kubernetes.io/instance";
pub const LABEL_COMPONENT: &str = "app.kubernetes.io/component";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Value of [`LABEL_NAME`] on node pods.
pub const NODE_APP_NAME: &str = "gantry-node";
/// Value of [`LABEL_COMPONENT`] on node pods.
pub const NODE_COMPONENT: &str = "node";
/// The Model a node pod serves. The selector of the Deployment, Service and PDB.
pub const LABEL_MODEL: &str = "gantry.dev/model";

/// Hash of the desired object the operator last applied. The apply step skips
/// an object whose live annotation equals the desired hash: that is what makes
/// a steady-state reconcile write nothing.
pub const ANNOTATION_APPLIED_HASH: &str = "gantry.dev/applied-hash";
/// Hash of the node's model config, on the pod template, so that a config change rolls the pods.
pub const ANNOTATION_CONFIG_HASH: &str = "gantry.dev/config-hash";
/// Comma-separated EnginePlugin names mounted into a node pod. The EnginePlugin
/// reconcile reads it to know which pods should report a plugin.
pub const ANNOTATION_PLUGINS: &str = "gantry.dev/engine-plugins";
/// Short hash of the Model's node token, on the pod template, so that a new token (the install
/// token was rotated) rolls the pods onto it. Never the token itself.
pub const ANNOTATION_NODE_TOKEN_HASH: &str = "gantry.dev/node-token-hash";
/// Hash of the node pod spec with the images of in-place plugins left out, on the pod template:
/// pods carrying the Deployment's value run its current template (not one a rollout is
/// replacing), whatever plugin version was since delivered to them.
pub const ANNOTATION_POD_SPEC_HASH: &str = "gantry.dev/pod-spec-hash";
/// On a node Deployment (not its template): the images of the plugins its template mounts that
/// take new versions in place (`{"<init container>": "<image>"}`, JSON). When an EnginePlugin's
/// image is all that changed, the build step keeps these in the template (no rollout) and the
/// deliver step brings the new image to the running pods as an ephemeral container.
pub const ANNOTATION_PLUGIN_IMAGES: &str = "gantry.dev/plugin-images";
/// Set by the gateway on a Model's node Deployment (RFC 3339 UTC time) when a request arrives for
/// a Model with no ready pod: the autoscaler reads it as "scale up from zero now".
pub const ANNOTATION_SCALE_UP_REQUESTED: &str = "gantry.dev/scale-up-requested-at";

/// Node pod contract: port, paths and directories (see docs/operator.md).
pub const NODE_PORT: i32 = 8080;
pub const NODE_PORT_NAME: &str = "http";
pub const NODE_CONFIG_DIR: &str = "/etc/gantry";
pub const NODE_CONFIG_FILE: &str = "models.yaml";
pub const NODE_PLUGINS_DIR: &str = "/opt/gantry/engines";
pub const NODE_CACHE_DIR: &str = "/var/cache/gantry";
pub const NODE_MODELS_DIR: &str = gantry_api::source::PVC_MOUNT_DIR;
/// Static copier shipped in every plugin image (InitContainer mount strategy).
pub const PLUGIN_COPIER: &str = "/copy";

/// Names of the objects a Model owns. All but the PVC and the node-token Secret carry the
/// Model's own name, which is why the Model name must be a DNS-1035 label (Service rule).
pub fn owned_name(model: &str) -> String {
    model.to_string()
}

/// The name of a ModelPool's objects (ConfigMap, Deployment, Service, PDB, node-token Secret
/// prefix): the pool's name and `-pool`, so a pool and a Model of the same name do not meet.
pub fn pool_object_name(pool: &str) -> String {
    format!("{pool}-pool")
}

/// The ModelPool a node pod serves, on the pool's objects and pods beside [`LABEL_MODEL`]
/// (which holds [`pool_object_name`] there, so the selectors of Models and pools never overlap).
pub const LABEL_POOL: &str = "gantry.dev/pool";
/// The kind of a pool, as owner references name it.
pub const POOL_KIND: &str = "ModelPool";

/// The Secret holding a Model's node token (key `token`), read by its node pods' env.
pub fn node_token_secret_name(model: &str) -> String {
    format!("{model}-node-token")
}

/// The cache PVC's name.
pub fn cache_claim_name(model: &str) -> String {
    format!("{model}-cache")
}

/// Selector labels shared by the Deployment, its pods, the Service and the PDB.
pub fn selector_labels(model: &str) -> std::collections::BTreeMap<String, String> {
    [
        (LABEL_NAME.to_string(), NODE_APP_NAME.to_string()),
        (LABEL_MODEL.to_string(), model.to_string()),
    ]
    .into_iter()
    .collect()
}

/// Labels on every owned object: the selector plus instance, component and manager.
pub fn object_labels(model: &str) -> std::collections::BTreeMap<String, String> {
    let mut labels = selector_labels(model);
    labels.insert(LABEL_INSTANCE.to_string(), model.to_string());
    labels.insert(LABEL_COMPONENT.to_string(), NODE_COMPONENT.to_string());
    labels.insert(LABEL_MANAGED_BY.to_string(), FIELD_MANAGER.to_string());
    labels
}

/// `key=value,...` form of a label map, for list calls.
pub fn label_selector(labels: &std::collections::BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}
