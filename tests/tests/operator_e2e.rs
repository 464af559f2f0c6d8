//! Operator end to end (outside the unit-test suite): against a real cluster, install the CRDs,
//! run the controllers in-process, apply the docs examples, wait for the Deployment and the
//! Model status, then delete the Model and check that everything it owned is gone.
//!
//! Opt-in: the test is `#[ignore]`d, so a plain `cargo test` lists it as ignored, never as
//! passed. `scripts/test.sh` runs it with `--ignored` when `GANTRY_E2E_KUBECONFIG` names the
//! kubeconfig of a disposable cluster (kind, k3d, minikube); run that way without the variable,
//! it fails.
//! Optional: `GANTRY_E2E_EXTERNAL_OPERATOR=1` when the cluster already runs the operator (the
//! test then does not start one), `GANTRY_E2E_WAIT_READY=1` to also wait for `Ready=True`
//! (needs the node and plugin images pullable by the cluster). With it,
//! `GANTRY_E2E_PLUGIN_NEXT=<image>@<version>` (a second build of the llama.cpp CPU plugin image
//! whose manifest says `<version>`) also delivers that version in place: the plugin runs in
//! `process` isolation, the test changes the EnginePlugin's image and waits until every node
//! pod runs the new version, with the same pods and no new Deployment generation.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use gantry_crd::{EnginePlugin, Model};
use gantry_operator::context::Settings;
use gantry_operator::controller::{RunConfig, run_with_client};
use gantry_operator::crdgen::generate;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, ResourceExt};

const MANAGER: &str = "gantry-e2e";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn example<T: serde::de::DeserializeOwned>(name: &str) -> anyhow::Result<T> {
    let path = repo().join("docs/examples").join(name);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    Ok(serde_yaml::from_str(&text)?)
}

/// Poll `check` every second until it returns `Some`, or fail after `limit`.
async fn wait_for<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn condition_is(model: &Model, type_: &str, status: &str) -> bool {
    model
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .is_some_and(|c| c.status == status)
}

#[tokio::test]
#[ignore = "needs a real cluster: set GANTRY_E2E_KUBECONFIG and run with --ignored (scripts/test.sh does)"]
async fn operator_end_to_end_on_a_real_cluster() {
    let Some(kubeconfig) = std::env::var_os("GANTRY_E2E_KUBECONFIG") else {
        panic!(
            "operator_e2e needs GANTRY_E2E_KUBECONFIG: the kubeconfig of a disposable cluster (kind, k3d, minikube)"
        );
    };
    if let Err(e) = end_to_end(PathBuf::from(kubeconfig)).await {
        panic!("operator end-to-end failed: {e:#}");
    }
}

async fn end_to_end(kubeconfig: PathBuf) -> anyhow::Result<()> {
    let kubeconfig = Kubeconfig::read_from(&kubeconfig).context("reading GANTRY_E2E_KUBECONFIG")?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    let client = Client::try_from(config)?;
    let apply = PatchParams::apply(MANAGER).force();

    // 1. CRDs, exactly as crdgen writes them, and wait until the apiserver serves them.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in generate::crds() {
        let name = crd.name_any();
        crds.patch(&name, &apply, &Patch::Apply(&crd))
            .await
            .with_context(|| format!("applying CRD {name}"))?;
        let established = kube::runtime::wait::conditions::is_crd_established();
        tokio::time::timeout(
            Duration::from_secs(60),
            kube::runtime::wait::await_condition(crds.clone(), &name, established),
        )
        .await
        .with_context(|| format!("CRD {name} not established"))??;
    }

    // 2. A namespace of our own, and the operator (unless the cluster runs one).
    let ns = format!("gantry-e2e-{}", std::process::id());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace: Namespace = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}
    }))?;
    namespaces
        .patch(&ns, &apply, &Patch::Apply(&namespace))
        .await?;
    let operator = if std::env::var_os("GANTRY_E2E_EXTERNAL_OPERATOR").is_none() {
        let config = RunConfig {
            settings: Settings::default(),
            metrics_addr: "127.0.0.1:0".parse()?,
            lease: None,
            concurrency: 4,
            reports: Default::default(),
            api_qps: 0,
            autoscaler: Some(gantry_operator::autoscale::AutoscalerConfig::default()),
        };
        Some(tokio::spawn(run_with_client(client.clone(), config)))
    } else {
        None
    };

    let outcome = exercise(&client, &ns, &apply).await;

    // Cleanup whatever happened: the namespace takes the Model's leftovers with it.
    let _ = Api::<EnginePlugin>::all(client.clone())
        .delete("llama-cpp-cpu", &DeleteParams::default())
        .await;
    let _ = namespaces.delete(&ns, &DeleteParams::background()).await;
    if let Some(op) = operator {
        op.abort();
    }
    outcome
}

/// Change `plugin`'s image to `next` (`<image>@<version>`) and wait until every node pod of
/// Model `name` runs that version, delivered in place: same pods, same Deployment generation,
/// a copy container in each pod, `Progressing` back to `RolloutComplete`.
async fn deliver_in_place(
    client: &Client,
    ns: &str,
    apply: &PatchParams,
    plugin: &EnginePlugin,
    name: &str,
    next: &str,
) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Pod;
    let (image, version) = next
        .rsplit_once('@')
        .context("GANTRY_E2E_PLUGIN_NEXT is <image>@<version>")?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = format!("gantry.dev/model={name}");
    let pod_names = |list: Vec<Pod>| {
        let mut names: Vec<String> = list.iter().map(ResourceExt::name_any).collect();
        names.sort();
        names
    };
    let before_pods = pod_names(
        pods.list(&kube::api::ListParams::default().labels(&selector))
            .await?
            .items,
    );
    let before_generation = deployments.get(name).await?.metadata.generation;

    let mut updated = plugin.clone();
    updated.spec.image = image.to_string();
    updated.spec.version = version.to_string();
    Api::<EnginePlugin>::all(client.clone())
        .patch(&plugin.name_any(), apply, &Patch::Apply(&updated))
        .await
        .context("changing the EnginePlugin's image")?;

    let models: Api<Model> = Api::namespaced(client.clone(), ns);
    wait_for(
        "every node pod to run the new version",
        Duration::from_secs(600),
        || async {
            let m = models.get(name).await?;
            let status = m.status.clone().unwrap_or_default();
            let halted = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Degraded" && c.reason == "PluginUpdateHalted");
            if let Some(c) = halted {
                bail!("the delivery halted: {}", c.message);
            }
            let list = pods
                .list(&kube::api::ListParams::default().labels(&selector))
                .await?
                .items;
            let copied = list.iter().all(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.ephemeral_containers.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.image.as_deref() == Some(image)))
            });
            let done = copied
                && status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Progressing" && c.reason == "RolloutComplete");
            Ok(done.then_some(()))
        },
    )
    .await?;
    let plugins: Api<EnginePlugin> = Api::all(client.clone());
    wait_for(
        "the EnginePlugin's status to count the pods on the new version",
        Duration::from_secs(60),
        || async {
            let status = plugins
                .get(&plugin.name_any())
                .await?
                .status
                .unwrap_or_default();
            let all_new = !status.versions.is_empty()
                && status
                    .versions
                    .iter()
                    .all(|v| v.version.as_deref() == Some(version));
            Ok(all_new.then_some(()))
        },
    )
    .await?;
    let after_pods = pod_names(
        pods.list(&kube::api::ListParams::default().labels(&selector))
            .await?
            .items,
    );
    anyhow::ensure!(
        after_pods == before_pods,
        "pods changed: {before_pods:?} -> {after_pods:?}"
    );
    let after_generation = deployments.get(name).await?.metadata.generation;
    anyhow::ensure!(
        after_generation == before_generation,
        "the Deployment changed: generation {before_generation:?} -> {after_generation:?}"
    );
    eprintln!(
        "operator_e2e: {version} delivered in place to {} pod(s)",
        after_pods.len()
    );
    Ok(())
}

async fn exercise(client: &Client, ns: &str, apply: &PatchParams) -> anyhow::Result<()> {
    // 3. The examples: the llama.cpp CPU plugin (in `process` isolation, so that a new
    // version is delivered in place) and the Gemma 3 270M Model.
    let mut plugin: EnginePlugin = example("engineplugin-llama-cpp-cpu.yaml")?;
    plugin.spec.isolation = Some(gantry_api::config::Isolation::Process);
    Api::<EnginePlugin>::all(client.clone())
        .patch(&plugin.name_any(), apply, &Patch::Apply(&plugin))
        .await
        .context("applying the EnginePlugin example")?;
    let mut model: Model = example("model-gemma-3-270m.yaml")?;
    model.metadata.namespace = Some(ns.to_string());
    let models: Api<Model> = Api::namespaced(client.clone(), ns);
    let name = model.name_any();
    models
        .patch(&name, apply, &Patch::Apply(&model))
        .await
        .context("applying the Model example")?;

    // 4. The operator resolves the engine and creates the owned objects.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let deployment = wait_for("the node Deployment", Duration::from_secs(120), || async {
        Ok(deployments.get_opt(&name).await?)
    })
    .await?;
    let owner = deployment
        .owner_references()
        .first()
        .context("Deployment has no owner")?;
    anyhow::ensure!(
        owner.kind == "Model" && owner.name == name,
        "unexpected owner {owner:?}"
    );
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get(&name)
        .await
        .context("ConfigMap")?;
    Api::<Service>::namespaced(client.clone(), ns)
        .get(&name)
        .await
        .context("Service")?;
    let resolved = wait_for(
        "EngineResolved=True in status",
        Duration::from_secs(120),
        || async {
            let m = models.get(&name).await?;
            let current =
                m.status.as_ref().and_then(|s| s.observed_generation) == m.metadata.generation;
            Ok((current && condition_is(&m, "EngineResolved", "True")).then_some(m))
        },
    )
    .await?;
    let status = resolved.status.context("status")?;
    anyhow::ensure!(
        status.engine.as_ref().map(|e| e.id.as_str()) == Some("llama_cpp"),
        "engine {:?}",
        status.engine
    );
    eprintln!(
        "operator_e2e: Deployment created, status {:?}",
        status.conditions
    );
    if std::env::var_os("GANTRY_E2E_WAIT_READY").is_some() {
        wait_for("Ready=True", Duration::from_secs(900), || async {
            let m = models.get(&name).await?;
            Ok(condition_is(&m, "Ready", "True").then_some(()))
        })
        .await?;
        if let Ok(next) = std::env::var("GANTRY_E2E_PLUGIN_NEXT") {
            deliver_in_place(client, ns, apply, &plugin, &name, &next).await?;
        }
    }

    // 5. Deleting the Model removes everything it owned (ownerReferences, no finalizer).
    models.delete(&name, &DeleteParams::background()).await?;
    wait_for(
        "the Model and its Deployment, ConfigMap and Service to go",
        Duration::from_secs(120),
        || async {
            let gone = models.get_opt(&name).await?.is_none()
                && deployments.get_opt(&name).await?.is_none()
                && Api::<ConfigMap>::namespaced(client.clone(), ns)
                    .get_opt(&name)
                    .await?
                    .is_none()
                && Api::<Service>::namespaced(client.clone(), ns)
                    .get_opt(&name)
                    .await?
                    .is_none();
            Ok(gone.then_some(()))
        },
    )
    .await?;
    Ok(())
}
