//! Generated objects against the Kubernetes types: every object the build step makes, every
//! golden file, the examples and the node config deserialize into their `k8s-openapi` (or
//! Gantry) type with no field dropped — an unknown or misspelt field would be.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gantry_crd::{EnginePlugin, Model, ModelPool, names};
use gantry_operator::context::Settings;
use gantry_operator::model::build;
use gantry_operator::model::resolve::resolve;
use gantry_operator::model::validate::validate;
use gantry_operator::pool::admit;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::support::{contains, crate_dir, fixture_model, fixture_plugins, repo_dir, yaml_docs};

/// Deserialize `value` as `K` (naming the failing path), serialize it back, and require that
/// everything in `value` survived: a field `K` does not know would be silently dropped.
pub fn assert_round_trips<K: DeserializeOwned + Serialize>(value: &Value, what: &str) {
    let typed: K = serde_path_to_error::deserialize(value.clone()).unwrap_or_else(|e| {
        panic!(
            "{what}: does not deserialize at {}: {}",
            e.path(),
            e.inner()
        )
    });
    let back = serde_json::to_value(&typed).expect("serialize");
    assert!(
        contains(&back, value),
        "{what}: fields were dropped or changed by {}:\noriginal: {value}\nread back: {back}",
        std::any::type_name::<K>()
    );
}

fn check_by_kind(doc: &Value, what: &str) {
    match doc["kind"].as_str() {
        Some("ConfigMap") => assert_round_trips::<ConfigMap>(doc, what),
        Some("Deployment") => assert_round_trips::<Deployment>(doc, what),
        Some("Service") => assert_round_trips::<Service>(doc, what),
        Some("PodDisruptionBudget") => assert_round_trips::<PodDisruptionBudget>(doc, what),
        Some("PersistentVolumeClaim") => assert_round_trips::<PersistentVolumeClaim>(doc, what),
        Some("HorizontalPodAutoscaler") => assert_round_trips::<HorizontalPodAutoscaler>(doc, what),
        Some("Secret") => assert_round_trips::<Secret>(doc, what),
        Some("NetworkPolicy") => assert_round_trips::<NetworkPolicy>(doc, what),
        other => panic!("{what}: unexpected kind {other:?}"),
    }
}

#[test]
fn every_built_object_reads_back_as_its_kubernetes_type() {
    for case in ["cpu", "gpu", "pvc-cache", "image-volume", "pinned", "hpa"] {
        let v = validate(&fixture_model(case), &Settings::default()).expect("valid");
        let r = resolve(
            &v,
            v.declared_architecture.as_deref(),
            &fixture_plugins(),
            1,
        );
        let secured = Settings {
            node_token: Some("0123456789abcdef0123456789abcdef".parse().expect("token")),
            network_policy: Some(gantry_operator::context::NodeNetworkPolicy {
                peer_namespace: "gantry-system".into(),
                metrics_namespace: Some("monitoring".into()),
                ..Default::default()
            }),
            ..Settings::default()
        };
        let o = build::build(&v, &r.mounted(), &secured).expect("build");
        let mut docs = vec![
            serde_json::to_value(&o.config_map).expect("json"),
            serde_json::to_value(&o.deployment).expect("json"),
            serde_json::to_value(&o.service).expect("json"),
        ];
        docs.extend(o.pvc.iter().map(|x| serde_json::to_value(x).expect("json")));
        docs.extend(o.pdb.iter().map(|x| serde_json::to_value(x).expect("json")));
        docs.extend(o.hpa.iter().map(|x| serde_json::to_value(x).expect("json")));
        docs.extend(
            o.node_token_secret
                .iter()
                .map(|x| serde_json::to_value(x).expect("json")),
        );
        docs.extend(
            o.network_policy
                .iter()
                .map(|x| serde_json::to_value(x).expect("json")),
        );
        assert_eq!(
            docs.len() - 3,
            [o.pvc.is_some(), o.pdb.is_some(), o.hpa.is_some()]
                .iter()
                .filter(|x| **x)
                .count()
                + 2
        );
        for doc in docs {
            assert!(
                doc["apiVersion"].is_string() && doc["kind"].is_string(),
                "{case}: {doc}"
            );
            check_by_kind(&doc, case);
        }
        // The node config inside the ConfigMap is exactly the node's config type.
        let text = &o.config_map.data.as_ref().expect("data")["models.yaml"];
        let yaml: Value = serde_yaml::from_str(text).expect("yaml");
        assert_round_trips::<gantry_api::NodeConfig>(&yaml, &format!("{case} models.yaml"));
    }
}

#[test]
fn golden_files_read_back_as_their_kubernetes_types() {
    for entry in std::fs::read_dir(crate_dir().join("tests/golden")).expect("golden dir") {
        let path = entry.expect("entry").path();
        for doc in yaml_docs::<Value>(&path) {
            check_by_kind(&doc, &path.display().to_string());
        }
    }
}

#[test]
fn examples_and_fixtures_read_back_as_gantry_resources() {
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(repo_dir().join("docs/examples"))
        .expect("examples")
        .map(|e| e.expect("entry").path())
        .collect();
    files.push(crate_dir().join("tests/fixtures/plugins.yaml"));
    files.extend(
        std::fs::read_dir(crate_dir().join("tests/fixtures/models"))
            .expect("fixtures")
            .map(|e| e.expect("entry").path()),
    );
    for path in files {
        for doc in yaml_docs::<Value>(&path) {
            let what = path.display().to_string();
            match doc["kind"].as_str() {
                Some("Model") => assert_round_trips::<Model>(&doc, &what),
                Some("EnginePlugin") => assert_round_trips::<EnginePlugin>(&doc, &what),
                Some("ModelPool") => assert_round_trips::<gantry_crd::ModelPool>(&doc, &what),
                other => panic!("{what}: unexpected kind {other:?}"),
            }
        }
    }
}

/// Every document of every file in `dir`, as `kubectl apply -f <dir>` reads them: the files in
/// lexical order (kubectl walks a folder so, taking `.yaml`, `.yml` and `.json`), the documents
/// in file order, empty ones (a trailing `---`) skipped; each with its file's name.
fn folder_documents(dir: &Path) -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            p.extension()
                .is_some_and(|x| x == "yaml" || x == "yml" || x == "json")
        })
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|path| {
            let file = path
                .file_name()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            yaml_docs::<Value>(path)
                .into_iter()
                .filter(|d| !d.is_null())
                .map(move |d| (file.clone(), d))
        })
        .collect()
}

/// What the apiserver keys an object by: group and kind, namespace (none for a cluster-scoped
/// kind such as EnginePlugin) and name. Two documents with one identity are one object.
fn identity(doc: &Value) -> String {
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    let kind = doc["kind"].as_str().unwrap_or_default();
    let name = doc["metadata"]["name"].as_str().unwrap_or_default();
    match doc["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{kind}.{group} {ns}/{name}"),
        None => format!("{kind}.{group} {name}"),
    }
}

/// `ns/name` of a namespaced object.
fn ns_name<K: ResourceExt>(o: &K) -> String {
    format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any())
}

/// What applying a folder of examples at once makes of them.
#[derive(Default)]
struct Folder {
    /// Every way in which a file would not do what it says, one line each.
    problems: Vec<String>,
    /// The objects the operator renders for the folder, `Kind ns/name` → who owns it
    /// (`Model ns/name` or `ModelPool ns/name`).
    rendered: BTreeMap<String, String>,
}

/// Apply every file of `dir` together, as `kubectl apply -f <dir>` would, and check that each
/// object still does what its file says: (a) no two documents are one object (the later would
/// replace the earlier); (b) no two Models share a served name (the gateway routes by it);
/// (c) every pool a Model joins and every engine a standalone Model pins is in the folder;
/// (d) every Model passes the operator's validation, a standalone Model's build step renders
/// its own Deployment, and a pool member renders none of its own but is admitted by its pool,
/// whose one Deployment serves them all; no two rendered objects meet.
fn apply_folder(dir: &Path) -> Folder {
    let settings = Settings::default();
    let docs = folder_documents(dir);
    let mut out = Folder::default();
    let problems = &mut out.problems;

    // (a) One object per identity.
    let mut declared: BTreeMap<String, &str> = BTreeMap::new();
    for (file, doc) in &docs {
        let id = identity(doc);
        if let Some(first) = declared.insert(id.clone(), file) {
            problems.push(format!(
                "{first} and {file} both declare {id}: applied together, the later overwrites the earlier"
            ));
        }
    }

    let mut models: Vec<(&str, Model)> = Vec::new();
    let mut pools: Vec<(&str, ModelPool)> = Vec::new();
    let mut plugins: Vec<EnginePlugin> = Vec::new();
    for (file, doc) in &docs {
        let what = format!("{file}: {}", identity(doc));
        match doc["kind"].as_str() {
            Some("Model") => models.push((file, typed(doc, &what))),
            Some("ModelPool") => pools.push((file, typed(doc, &what))),
            Some("EnginePlugin") => plugins.push(typed(doc, &what)),
            other => problems.push(format!("{what}: unexpected kind {other:?}")),
        }
    }

    // (b) One Model per served name: `spec.servedName`, else the Model's name, as the operator's
    // validation (`ValidModel::served_name`) and the gateway's discovery derive it. The gateway's
    // route table is keyed by that id alone, across namespaces, so a second claimant is never
    // routed to; within a pool, the younger member is refused (`ServedNameTaken`).
    let mut served: BTreeMap<String, String> = BTreeMap::new();
    for (file, m) in &models {
        let id = m.spec.served_name.clone().unwrap_or_else(|| m.name_any());
        let who = format!("{file}: Model {}", ns_name(m));
        if let Some(first) = served.insert(id.clone(), who.clone()) {
            problems.push(format!("{first} and {who} both serve {id:?}"));
        }
    }

    // (c) What a Model or pool names is in the folder.
    for (file, m) in &models {
        let who = format!("{file}: Model {}", ns_name(m));
        match &m.spec.pool {
            Some(pool) => {
                let found = pools
                    .iter()
                    .any(|(_, p)| p.namespace() == m.namespace() && p.name_any() == *pool);
                if !found {
                    problems.push(format!(
                        "{who} joins ModelPool {pool:?}, which no file declares in its namespace"
                    ));
                }
            }
            None => {
                if let Some(engine) = &m.spec.engine
                    && !plugins.iter().any(|p| p.spec.engine_id == *engine)
                {
                    problems.push(format!(
                        "{who} pins engine {engine:?}, which no EnginePlugin in the folder provides"
                    ));
                }
            }
        }
    }
    for (file, pool) in &pools {
        for name in &pool.spec.engine_plugins {
            if !plugins.iter().any(|p| p.name_any() == *name) {
                problems.push(format!(
                    "{file}: ModelPool {} allows EnginePlugin {name:?}, which no file declares",
                    ns_name(pool)
                ));
            }
        }
    }

    // (d) What the operator makes of each Model: validation, then its own objects for a
    // standalone Model, its pool's for a member.
    for (file, m) in &models {
        let who = format!("{file}: Model {}", ns_name(m));
        let v = match validate(m, &settings) {
            Ok(v) => v,
            Err(p) => {
                out.problems.push(format!(
                    "{who} is invalid: {}",
                    gantry_operator::model::validate::message(&p)
                ));
                continue;
            }
        };
        if v.pool.is_some() {
            // Its reconcile stops at the member status (`model::reconcile_model`): the pool's
            // pods serve it. Checked with the pool below.
            continue;
        }
        let r = resolve(
            &v,
            v.declared_architecture.as_deref(),
            &plugins,
            settings.abi_major,
        );
        let mounted = r.mounted();
        if mounted.is_empty() {
            out.problems.push(format!(
                "{who}: no EnginePlugin in the folder can serve it, so it gets no Deployment: {r:?}"
            ));
            continue;
        }
        let o = match build::build(&v, &mounted, &settings) {
            Ok(o) => o,
            Err(e) => {
                out.problems
                    .push(format!("{who}: the build step fails: {e}"));
                continue;
            }
        };
        let deployment = (
            o.deployment.metadata.namespace.clone(),
            o.deployment.metadata.name.clone(),
        );
        if deployment != (m.namespace(), Some(names::owned_name(&m.name_any()))) {
            out.problems.push(format!(
                "{who}: its Deployment is {deployment:?}, not its own"
            ));
        }
        record(&mut out, &o, format!("Model {}", ns_name(m)));
    }
    for (file, pool) in &pools {
        let who = format!("{file}: ModelPool {}", ns_name(pool));
        let members: Vec<Model> = models
            .iter()
            .map(|(_, m)| m)
            .filter(|m| {
                m.namespace() == pool.namespace()
                    && m.spec.pool.as_deref() == Some(&pool.name_any())
            })
            .cloned()
            .collect();
        if members.is_empty() {
            out.problems.push(format!(
                "{who} has no member in the folder, so it renders no Deployment"
            ));
            continue;
        }
        let template = match admit::template(pool, &settings) {
            Ok(t) => t,
            Err(p) => {
                out.problems.push(format!(
                    "{who} is invalid: {}",
                    gantry_operator::model::validate::message(&p)
                ));
                continue;
            }
        };
        // Oldest first: the apiserver creates them in file order.
        let allowed = admit::allowed_plugins(pool, plugins.clone());
        let admission = admit::admit(pool, &template, &members, &[], &allowed, &settings);
        for r in &admission.refused {
            out.problems.push(format!(
                "{who} refuses its member {}: {}: {}",
                r.name, r.reason, r.message
            ));
        }
        if admission.members.is_empty() {
            out.problems.push(format!(
                "{who} admits no member, so it renders no Deployment"
            ));
            continue;
        }
        let config = match admit::render(pool, &admission) {
            Ok(c) => c,
            Err(e) => {
                out.problems
                    .push(format!("{who}: its node config does not render: {e}"));
                continue;
            }
        };
        let listed: gantry_api::NodeConfig =
            serde_yaml::from_str(&config.config.yaml).expect("node config");
        let listed: Vec<String> = listed.models.into_iter().map(|m| m.id).collect();
        let mut want: Vec<String> = admission
            .members
            .iter()
            .map(|m| m.valid.served_name.clone())
            .collect();
        want.sort();
        if listed != want {
            out.problems.push(format!(
                "{who}: its pods' config lists {listed:?}, not its members {want:?}"
            ));
        }
        let pod = gantry_operator::model::node_config::RenderedConfig {
            yaml: config.config.yaml.clone(),
            hash: config.pod_hash.clone(),
        };
        let o = match build::assemble(&template, &pod, &admission.mounted(), &settings) {
            Ok(o) => o,
            Err(e) => {
                out.problems
                    .push(format!("{who}: the build step fails: {e}"));
                continue;
            }
        };
        let deployment = o.deployment.metadata.name.clone();
        if deployment != Some(names::pool_object_name(&pool.name_any())) {
            out.problems.push(format!(
                "{who}: its Deployment is {deployment:?}, not the pool's"
            ));
        }
        record(&mut out, &o, format!("ModelPool {}", ns_name(pool)));
    }
    // A member has no object of its own: nothing rendered may bear its name but what its
    // Model declares elsewhere, and (a) already refuses that.
    for (file, m) in &models {
        let Some(pool) = &m.spec.pool else { continue };
        let own = format!("Deployment {}", ns_name(m));
        let pools_own = format!("ModelPool {}/{pool}", m.namespace().unwrap_or_default());
        if let Some(owner) = out.rendered.get(&own)
            && *owner != pools_own
        {
            out.problems.push(format!(
                "{file}: Model {} is a pool member, yet {owner} renders {own}",
                ns_name(m)
            ));
        }
    }
    out
}

/// Record the objects `owner` renders in `out`, and any that another owner renders too.
fn record(out: &mut Folder, o: &build::OwnedObjects, owner: String) {
    let metas = [
        ("ConfigMap", &o.config_map.metadata),
        ("Deployment", &o.deployment.metadata),
        ("Service", &o.service.metadata),
    ]
    .into_iter()
    .chain(o.pvc.iter().map(|x| ("PersistentVolumeClaim", &x.metadata)))
    .chain(o.pdb.iter().map(|x| ("PodDisruptionBudget", &x.metadata)));
    for (kind, meta) in metas {
        let key = format!(
            "{kind} {}/{}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default()
        );
        if let Some(first) = out.rendered.insert(key.clone(), owner.clone()) {
            out.problems.push(format!(
                "{first} and {owner} both render {key}: one would take the other's"
            ));
        }
    }
}

fn typed<K: DeserializeOwned>(doc: &Value, what: &str) -> K {
    serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{what}: {e}"))
}

#[test]
fn the_examples_folder_applies_as_a_whole() {
    let folder = apply_folder(&repo_dir().join("docs/examples"));
    assert!(
        folder.problems.is_empty(),
        "`kubectl apply -f docs/examples/` would not do what the files say:\n{}",
        folder.problems.join("\n")
    );
    // There was something to check: a standalone Model's Deployment and a pool's.
    let deployments: Vec<&str> = folder
        .rendered
        .iter()
        .filter(|(k, _)| k.starts_with("Deployment "))
        .map(|(_, owner)| owner.split(' ').next().unwrap_or_default())
        .collect();
    assert!(deployments.contains(&"Model"), "{:?}", folder.rendered);
    assert!(deployments.contains(&"ModelPool"), "{:?}", folder.rendered);
}

/// The check itself catches what once broke the folder: a pool member with the standalone
/// Model's name and served name, and a folder without the EnginePlugin its Models need.
#[test]
fn applying_the_examples_folder_catches_a_member_named_as_the_standalone_model() {
    let examples = repo_dir().join("docs/examples");
    let copy = |skip: &str| {
        let dir = tempfile::tempdir().expect("tempdir");
        for entry in std::fs::read_dir(&examples).expect("examples") {
            let path = entry.expect("entry").path();
            if path.file_name().is_some_and(|n| n != skip) {
                std::fs::copy(&path, dir.path().join(path.file_name().expect("name")))
                    .expect("copy");
            }
        }
        dir
    };

    // The pool file as it was: its first member took the standalone Model's name and served name.
    let docs = folder_documents(&examples);
    let (standalone_file, standalone) = docs
        .iter()
        .find(|(_, d)| d["kind"] == "Model" && d["spec"]["pool"].is_null())
        .expect("a standalone Model");
    let (pool_file, pool) = docs
        .iter()
        .find(|(_, d)| d["kind"] == "ModelPool")
        .expect("a ModelPool");
    let mut twin = standalone.clone();
    twin["spec"] = serde_json::json!({
        "pool": pool["metadata"]["name"],
        "source": standalone["spec"]["source"],
        "format": standalone["spec"]["format"],
        "architecture": standalone["spec"]["architecture"],
        "servedName": standalone["spec"]["servedName"],
        "resources": {"memory": "600Mi"},
    });
    let dir = copy("");
    let path = dir.path().join(pool_file);
    let mut text = std::fs::read_to_string(&path).expect("pool file");
    text.push_str("---\n");
    text.push_str(&serde_yaml::to_string(&twin).expect("yaml"));
    std::fs::write(&path, text).expect("write");
    let problems = apply_folder(dir.path()).problems;
    let name = standalone["metadata"]["name"].as_str().expect("name");
    let namespace = standalone["metadata"]["namespace"]
        .as_str()
        .expect("namespace");
    assert!(
        problems.iter().any(|p| p.starts_with(&format!(
            "{standalone_file} and {pool_file} both declare Model.gantry.dev {namespace}/{name}:"
        ))),
        "{problems:#?}"
    );
    let served = standalone["spec"]["servedName"].as_str().expect("served");
    assert!(
        problems
            .iter()
            .any(|p| p.ends_with(&format!("both serve {served:?}"))),
        "{problems:#?}"
    );

    // Without the EnginePlugin: the standalone Model's pinned engine and the pool's allowed
    // plugin are missing, and neither gets a Deployment.
    let dir = copy("engineplugin-llama-cpp-cpu.yaml");
    let folder = apply_folder(dir.path());
    let problems = folder.problems.join("\n");
    assert!(problems.contains("pins engine \"llama_cpp\""), "{problems}");
    assert!(
        problems.contains("allows EnginePlugin \"llama-cpp-cpu\""),
        "{problems}"
    );
    assert!(problems.contains("so it gets no Deployment"), "{problems}");
    assert!(
        !folder.rendered.keys().any(|k| k.starts_with("Deployment ")),
        "{:?}",
        folder.rendered
    );
}
