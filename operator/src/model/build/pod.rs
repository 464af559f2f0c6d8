//! Model reconcile, build step (pure, no client): the node pod template of a Model's
//! Deployment — volumes, mounts, plugin init containers and image volumes, the node container
//! with its env, probes and resources, and the restricted security context.
//!
//! Called only by `model::build` when it assembles the Deployment; like the rest of the build
//! step its output depends only on its inputs.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvFromSource, EnvVar, EnvVarSource, HTTPGetAction, ImageVolumeSource, KeyToPath,
    ObjectFieldSelector, PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, Probe,
    ResourceRequirements, SeccompProfile, SecretEnvSource, SecretKeySelector, SecurityContext,
    Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::context::Settings;
use crate::model::validate::ValidModel;
use gantry_api::config::Isolation;
use gantry_api::node_token::{NODE_TOKEN_ENV, NODE_TOKEN_SECRET_KEY};
use gantry_crd::names::*;
use gantry_crd::{CacheType, EnginePlugin, MountStrategy};

/// The pod volume that holds the plugins (an emptyDir at `NODE_PLUGINS_DIR`).
pub const ENGINES: &str = "engines";

/// The plugin init containers of a pod mounting `plugins` whose plugin takes new versions in
/// the running pod, by container name: mounted by an init container (a new version can be
/// copied in the same way) and run in `process` isolation (the node shadow-loads a changed
/// library; in-process code cannot be replaced in a running node).
pub fn in_place_slots<'a>(plugins: &[&'a EnginePlugin]) -> Vec<(String, &'a EnginePlugin)> {
    plugins
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            p.spec.mount_strategy == MountStrategy::InitContainer
                && p.spec.isolation == Some(Isolation::Process)
        })
        .map(|(i, p)| (plugin_slot_name(i, p), *p))
        .collect()
}

/// The plugin image's copy command: `/copy <libraryPath> <plugin directory on the node>`.
pub fn copy_command(plugin: &EnginePlugin) -> Vec<String> {
    vec![
        PLUGIN_COPIER.to_string(),
        plugin.spec.library_path(),
        plugin_target(plugin),
    ]
}

/// The engines volume, writable, where a plugin copy (init or ephemeral container) mounts it.
pub fn engines_mount() -> VolumeMount {
    mount(ENGINES, NODE_PLUGINS_DIR, false)
}

/// The pod spec of `model`'s node pods, mounting `plugins`; with `node_token`, the node reads
/// its token from the Model's node-token Secret.
pub fn pod_spec(
    model: &ValidModel,
    plugins: &[&EnginePlugin],
    node_token: bool,
    settings: &Settings,
) -> PodSpec {
    const CONFIG: &str = "config";
    const CACHE: &str = "cache";
    const TMP: &str = "tmp";
    const SOURCE: &str = "model-source";

    let mut volumes = vec![
        Volume {
            name: CONFIG.to_string(),
            config_map: Some(ConfigMapVolumeSource {
                name: owned_name(&model.name),
                items: Some(vec![KeyToPath {
                    key: NODE_CONFIG_FILE.to_string(),
                    path: NODE_CONFIG_FILE.to_string(),
                    ..KeyToPath::default()
                }]),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        },
        empty_dir(ENGINES, Some(Quantity("2Gi".to_string()))),
        match model.cache.type_ {
            CacheType::EmptyDir => empty_dir(CACHE, model.cache.size.clone()),
            CacheType::PersistentVolumeClaim => Volume {
                name: CACHE.to_string(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: cache_claim_name(&model.name),
                    read_only: Some(false),
                }),
                ..Volume::default()
            },
        },
        // The root filesystem is read-only; the node may still need scratch space.
        empty_dir(TMP, Some(Quantity("1Gi".to_string()))),
    ];
    let image_volumes = plugins
        .iter()
        .any(|p| p.spec.mount_strategy == MountStrategy::ImageVolume);
    let mut node_mounts = vec![
        mount(CONFIG, NODE_CONFIG_DIR, true),
        // Read-only unless image volumes are nested inside it: the runtime must be able to
        // create their mount points.
        mount(ENGINES, NODE_PLUGINS_DIR, !image_volumes),
        mount(CACHE, NODE_CACHE_DIR, false),
        mount(TMP, "/tmp", false),
    ];
    if let Some(claim) = &model.source.claim {
        volumes.push(Volume {
            name: SOURCE.to_string(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.clone(),
                read_only: Some(true),
            }),
            ..Volume::default()
        });
        node_mounts.push(mount(SOURCE, &format!("{NODE_MODELS_DIR}/{claim}"), true));
    }
    // Each other claim an adapter's `pvc://` source names, once, the same way: the adapter's
    // node URI points at `/models/<claim>/...`.
    let mut claims: Vec<&str> = model.source.claim.iter().map(String::as_str).collect();
    for claim in model.adapters.iter().filter_map(|a| a.claim.as_deref()) {
        if claims.contains(&claim) {
            continue;
        }
        claims.push(claim);
        let name = format!("{SOURCE}-{}", claims.len());
        volumes.push(Volume {
            name: name.clone(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.to_string(),
                read_only: Some(true),
            }),
            ..Volume::default()
        });
        node_mounts.push(mount(&name, &format!("{NODE_MODELS_DIR}/{claim}"), true));
    }

    // Engine selection never hands over two plugins with the same engine id and backend, so
    // each plugin gets its own `/opt/gantry/engines/{engineId}/{gpuBackend}` directory.
    let mut init_containers = Vec::new();
    for (i, plugin) in plugins.iter().enumerate() {
        let slot = plugin_slot_name(i, plugin);
        let target = plugin_target(plugin);
        match plugin.spec.mount_strategy {
            MountStrategy::InitContainer => init_containers.push(Container {
                name: slot,
                image: Some(plugin.spec.image.clone()),
                image_pull_policy: Some("IfNotPresent".to_string()),
                command: Some(copy_command(plugin)),
                volume_mounts: Some(vec![engines_mount()]),
                resources: Some(ResourceRequirements {
                    requests: Some(BTreeMap::from([
                        ("cpu".to_string(), Quantity("10m".to_string())),
                        ("memory".to_string(), Quantity("32Mi".to_string())),
                    ])),
                    limits: Some(BTreeMap::from([(
                        "memory".to_string(),
                        Quantity("128Mi".to_string()),
                    )])),
                    ..ResourceRequirements::default()
                }),
                security_context: Some(restricted_container_security()),
                ..Container::default()
            }),
            MountStrategy::ImageVolume => {
                volumes.push(Volume {
                    name: slot.clone(),
                    image: Some(ImageVolumeSource {
                        reference: Some(plugin.spec.image.clone()),
                        pull_policy: Some("IfNotPresent".to_string()),
                    }),
                    ..Volume::default()
                });
                node_mounts.push(VolumeMount {
                    sub_path: Some(
                        plugin
                            .spec
                            .library_path()
                            .trim_start_matches('/')
                            .to_string(),
                    ),
                    ..mount(&slot, &target, true)
                });
            }
        }
    }

    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    if let Some(cpu) = &model.cpu {
        // CPU is requested, not limited: CFS throttling stalls token generation.
        requests.insert("cpu".to_string(), cpu.clone());
    }
    if let Some(mem) = &model.memory {
        requests.insert("memory".to_string(), mem.clone());
        limits.insert("memory".to_string(), mem.clone());
    }
    if model.gpus > 0 {
        let gpus = Quantity(model.gpus.to_string());
        requests.insert(model.gpu_resource.clone(), gpus.clone());
        limits.insert(model.gpu_resource.clone(), gpus);
    }

    let mut env = vec![
        EnvVar {
            name: "GANTRY_BACKEND".to_string(),
            value: Some(model.backend.as_str().to_string()),
            ..EnvVar::default()
        },
        env_from_field("POD_NAME", "metadata.name"),
        env_from_field("POD_NAMESPACE", "metadata.namespace"),
    ];
    // Only a reference: the token is in no object but its Secret. An explicit `env` entry
    // wins over the source Secret's `envFrom`, so that Secret cannot replace it.
    if node_token {
        env.push(env_from_secret(
            NODE_TOKEN_ENV,
            &node_token_secret_name(&model.name),
            NODE_TOKEN_SECRET_KEY,
        ));
    }
    // The token never enters the ConfigMap: only a reference to the Secret reaches the pod.
    // It is the pod's one source credential: adapters may only name the same Secret (validate
    // step), so an adapter on Hugging Face or S3 gets it the way a base model there would.
    let hugging_face =
        model.source.is_hugging_face() || model.adapters.iter().any(|a| a.is_hugging_face());
    let s3 = model.source.is_s3() || model.adapters.iter().any(|a| a.is_s3());
    if let Some((secret, key)) = &model.source.secret {
        env.push(env_from_secret("GANTRY_SOURCE_TOKEN", secret, key));
        if hugging_face {
            env.push(env_from_secret("HF_TOKEN", secret, key));
        }
    }
    // S3 credentials and endpoint come as the standard `AWS_*` keys of the same Secret
    // (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optional `AWS_SESSION_TOKEN`,
    // `AWS_ENDPOINT_URL`, `AWS_REGION`): the whole Secret is exposed as environment.
    let env_from = match &model.source.secret {
        Some((secret, _)) if s3 => Some(vec![EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: secret.clone(),
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        }]),
        _ => None,
    };

    let node = Container {
        name: "node".to_string(),
        image: Some(settings.node_image.clone()),
        image_pull_policy: Some("IfNotPresent".to_string()),
        command: Some(vec!["gantry-node".to_string()]),
        args: Some(vec![
            "serve".to_string(),
            "--config".to_string(),
            format!("{NODE_CONFIG_DIR}/{NODE_CONFIG_FILE}"),
            "--plugins-dir".to_string(),
            NODE_PLUGINS_DIR.to_string(),
            "--listen".to_string(),
            format!("0.0.0.0:{NODE_PORT}"),
        ]),
        env: Some(env),
        env_from,
        ports: Some(vec![ContainerPort {
            name: Some(NODE_PORT_NAME.to_string()),
            container_port: NODE_PORT,
            protocol: Some("TCP".to_string()),
            ..ContainerPort::default()
        }]),
        // Start-up covers download and eager load: up to an hour before liveness takes over.
        startup_probe: Some(http_probe("/readyz", 10, 360, 2)),
        readiness_probe: Some(http_probe("/readyz", 5, 3, 2)),
        liveness_probe: Some(http_probe("/healthz", 10, 3, 5)),
        resources: Some(ResourceRequirements {
            requests: (!requests.is_empty()).then_some(requests),
            limits: (!limits.is_empty()).then_some(limits),
            ..ResourceRequirements::default()
        }),
        security_context: Some(restricted_container_security()),
        volume_mounts: Some(node_mounts),
        ..Container::default()
    };

    let scheduling = &model.scheduling;
    PodSpec {
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        // The node drains in-flight streams on SIGTERM.
        termination_grace_period_seconds: Some(60),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            fs_group: Some(65532),
            seccomp_profile: Some(runtime_default_seccomp()),
            ..PodSecurityContext::default()
        }),
        node_selector: (!scheduling.node_selector.is_empty())
            .then(|| scheduling.node_selector.clone()),
        tolerations: (!scheduling.tolerations.is_empty()).then(|| scheduling.tolerations.clone()),
        affinity: scheduling.affinity.clone(),
        runtime_class_name: scheduling.runtime_class_name.clone(),
        init_containers: (!init_containers.is_empty()).then_some(init_containers),
        containers: vec![node],
        volumes: Some(volumes),
        ..PodSpec::default()
    }
}

/// Restricted Pod Security Standard, container level.
pub fn restricted_container_security() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_string()]),
            ..Capabilities::default()
        }),
        seccomp_profile: Some(runtime_default_seccomp()),
        ..SecurityContext::default()
    }
}

fn runtime_default_seccomp() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".to_string(),
        ..SeccompProfile::default()
    }
}

fn http_probe(path: &str, period: i32, failures: i32, timeout: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String(NODE_PORT_NAME.to_string()),
            scheme: Some("HTTP".to_string()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(timeout),
        ..Probe::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_string(),
        mount_path: path.to_string(),
        read_only: Some(read_only),
        ..VolumeMount::default()
    }
}

fn empty_dir(name: &str, size_limit: Option<Quantity>) -> Volume {
    Volume {
        name: name.to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit,
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// `plugin-{i}-{engine}-{backend}`, a valid container and volume name (DNS label, ≤ 63).
fn plugin_slot_name(index: usize, plugin: &EnginePlugin) -> String {
    let engine: String = plugin
        .spec
        .engine_id
        .chars()
        .map(|c| if c == '_' { '-' } else { c })
        .collect();
    let mut name = format!(
        "plugin-{index}-{engine}-{}",
        plugin.spec.gpu_backend.as_str()
    );
    name.truncate(63);
    name.trim_end_matches('-').to_string()
}

/// Where a plugin lives on the node: `/opt/gantry/engines/{engineId}/{gpuBackend}`.
fn plugin_target(plugin: &EnginePlugin) -> String {
    format!(
        "{NODE_PLUGINS_DIR}/{}/{}",
        plugin.spec.engine_id,
        plugin.spec.gpu_backend.as_str()
    )
}

fn env_from_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_string(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn env_from_secret(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_string(),
                key: key.to_string(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}
