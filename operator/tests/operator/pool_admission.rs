//! ModelPool admission (validate, admit and render steps of a pool reconcile): which members a
//! pool takes and why it refuses the others, in its status and in the member's own, and the
//! node-wide settings the render step puts on the pods' hash.

use std::collections::BTreeMap;

use gantry_crd::ModelPool;
use gantry_operator::context::Settings;
use gantry_operator::model::validate::validate;
use gantry_operator::pool::admit;
use kube::runtime::controller::Action;

use crate::pool::{
    built, example, member, model_status_patch, pool_context, pool_path, pool_status_patch,
    run_model, run_pool, seed_live, status_of,
};
use crate::reconcile::example_plugins;
use crate::support::{Step, condition, context_full, finish};

#[tokio::test]
async fn a_member_that_cannot_fit_is_refused_with_its_reason_and_the_pool_is_untouched() {
    let (pool, members) = example();
    let (live, _) = built(&pool, &members);
    // modelMemory is 2Gi: 90 % of it is 1,932,735,283 bytes; 3Gi can never load.
    let big = member("big", "big-model", "3Gi", 3);
    let mut all = members.clone();
    all.push(big.clone());
    let (ctx, mut server) = pool_context(pool.clone(), all.clone(), BTreeMap::new());
    seed_live(&mut server, &live, 2);
    // No object write: the config is what it was. Only the pool's status says why.
    let server = server.run(vec![pool_status_patch(&pool)]);
    run_pool(pool.clone(), ctx.clone())
        .await
        .expect("reconcile");
    let recorded = finish(server).await;
    let status = status_of(&recorded);
    assert_eq!(status["modelCount"], 3);
    assert_eq!(status["refused"][0]["name"], "big");
    assert_eq!(status["refused"][0]["reason"], "DoesNotFit");
    let message = status["refused"][0]["message"].as_str().expect("message");
    assert!(
        message.contains("spec.resources.memory (3221225472 bytes)"),
        "{message}"
    );
    assert!(message.contains("1932735283 bytes"), "{message}");

    // The member itself: Ready=False with the same reason, no objects of its own.
    let (ctx, server) = pool_context(pool.clone(), all, BTreeMap::new());
    let server = server.run(vec![model_status_patch(&big), Step::event("default")]);
    run_model(big, ctx).await.expect("member reconcile");
    let recorded = finish(server).await;
    let status = status_of(&recorded);
    let ready = condition(&status, "Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("False"), Some("DoesNotFit"))
    );
    assert!(
        ready["message"]
            .as_str()
            .is_some_and(|m| m.contains("the ModelPool `small` refuses it"))
    );
    assert_eq!(status["pool"]["name"], "small");
}

#[tokio::test]
async fn a_member_whose_format_no_allowed_engine_serves_is_refused() {
    let (pool, mut members) = example();
    members[2].spec.format = gantry_crd::ModelFormat::Safetensors;
    members[2].spec.source.quantization = None;
    let (ctx, server) = pool_context(pool.clone(), members.clone(), BTreeMap::new());
    let server = server.run(vec![
        Step::apply(pool_path("configmaps")),
        Step::apply(pool_path("deployments")),
        Step::apply(pool_path("deployments")).by("gantry-autoscaler"),
        Step::apply(pool_path("services")),
        Step::apply(pool_path("poddisruptionbudgets")),
        pool_status_patch(&pool),
    ]);
    run_pool(pool, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    let status = status_of(&recorded);
    assert_eq!(status["modelCount"], 2);
    assert_eq!(status["refused"][0]["name"], "smollm2-135m");
    assert_eq!(status["refused"][0]["reason"], "EngineUnresolved");
    assert!(
        status["refused"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("llama-cpp-cpu")),
        "{status}"
    );
}

#[tokio::test]
async fn a_member_of_a_pool_that_does_not_exist_is_refused() {
    let (_, members) = example();
    let m = members[0].clone();
    let (ctx, server) = context_full(
        Settings::default(),
        example_plugins(),
        BTreeMap::new(),
        members,
        vec![],
    );
    let server = server.run(vec![model_status_patch(&m), Step::event("default")]);
    let action = run_model(m, ctx).await.expect("reconcile");
    let recorded = finish(server).await;
    assert_eq!(action, Action::await_change());
    let status = status_of(&recorded);
    assert_eq!(condition(&status, "Ready")["reason"], "PoolNotFound");
    assert_eq!(condition(&status, "Degraded")["status"], "True");
}

#[test]
fn a_member_may_not_shape_pods_or_bring_its_own_volume_or_secret() {
    let (_, members) = example();
    let mut m = members[0].clone();
    m.spec.replicas = Some(gantry_crd::Replicas { min: 1, max: 3 });
    m.spec.source.secret_ref = Some(gantry_crd::SecretKeyRef {
        name: "hf".into(),
        key: None,
    });
    let problems = validate(&m, &Settings::default()).expect_err("invalid");
    let message = gantry_operator::model::validate::message(&problems);
    assert!(
        message.contains("spec.replicas: belongs to the ModelPool `small`"),
        "{message}"
    );
    assert!(message.contains("spec.source.secretRef"), "{message}");
    // Lazy loading is fine for a member (a dedicated Model refuses it).
    let mut lazy = members[0].clone();
    lazy.spec.load = gantry_crd::LoadPolicy::Lazy;
    assert!(validate(&lazy, &Settings::default()).is_ok());
}

#[test]
fn two_members_with_one_served_name_keep_the_older() {
    let (pool, members) = example();
    let settings = Settings::default();
    let template = admit::template(&pool, &settings).expect("template");
    let mut twin = member("twin", "gemma-3-270m-q8_0", "100Mi", 7);
    twin.spec.architecture = Some("gemma3".into());
    let mut all = members.clone();
    all.push(twin);
    let a = admit::admit(&pool, &template, &all, &[], &example_plugins(), &settings);
    assert_eq!(a.members.len(), 3);
    assert_eq!(a.refused[0].name, "twin");
    assert_eq!(a.refused[0].reason, "ServedNameTaken");
}

#[test]
fn a_member_whose_adapter_id_an_older_member_serves_is_refused_and_adapters_render() {
    let (pool, mut members) = example();
    let settings = Settings::default();
    let template = admit::template(&pool, &settings).expect("template");
    members[0].spec.adapters = serde_json::from_value(serde_json::json!([
        {"name": "pirate", "source": {"uri": "hf://org/pirate"}, "servedName": "pirate-bot"},
    ]))
    .expect("adapters");
    // A younger member whose adapter takes the older member's adapter id.
    let mut late = member("late", "late-model", "100Mi", 7);
    late.spec.adapters = serde_json::from_value(serde_json::json!([
        {"name": "copy", "source": {"uri": "hf://org/copy"}, "servedName": "pirate-bot"},
    ]))
    .expect("adapters");
    let mut all = members.clone();
    all.push(late);
    let a = admit::admit(&pool, &template, &all, &[], &example_plugins(), &settings);
    assert_eq!(a.members.len(), 3);
    assert_eq!(
        (
            a.refused[0].name.as_str(),
            a.refused[0].reason.as_str(),
            a.refused[0].message.as_str()
        ),
        (
            "late",
            "ServedNameTaken",
            "adapter id \"pirate-bot\" is already served by an older member of the pool"
        )
    );
    // The admitted member's adapter is in the pool's one node config.
    let (config, entry) = rendered(&pool, &a, &members[0]);
    assert_eq!(entry.adapters[0].model_id(&entry.id), "pirate-bot");
    assert!(config.models.len() > 1);
}

/// The pool's rendered node config, which the node accepts, and `member`'s entry in it.
fn rendered(
    pool: &ModelPool,
    a: &admit::Admission,
    member: &gantry_crd::Model,
) -> (gantry_api::NodeConfig, gantry_api::ModelConfig) {
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(&admit::render(pool, a).expect("render").config.yaml).expect("config");
    config
        .validate()
        .expect("the node accepts the pool's config");
    let served = member.spec.served_name.clone().expect("served name");
    let entry = config
        .models
        .iter()
        .find(|m| m.id == served)
        .cloned()
        .expect("member");
    (config, entry)
}

/// `member` drafts with `draft` (a served name), `draftTokens` as given.
fn drafts_with(member: &mut gantry_crd::Model, draft: &str, draft_tokens: Option<i32>) {
    member
        .spec
        .engine_config
        .get_or_insert_default()
        .speculation = Some(gantry_crd::model::Speculation {
        method: gantry_crd::model::SpeculationMethod::DraftModel,
        draft_model: Some(draft.to_string()),
        draft_tokens,
        ..Default::default()
    });
}

#[test]
fn a_member_drafts_with_another_member_of_its_pool() {
    let (pool, mut members) = example();
    let settings = Settings::default();
    let template = admit::template(&pool, &settings).expect("template");
    let draft = members[1].spec.served_name.clone().expect("served name");
    drafts_with(&mut members[0], &draft, Some(4));
    validate(&members[0], &settings).expect("a pool member may draft with another member");
    let a = admit::admit(
        &pool,
        &template,
        &members,
        &[],
        &example_plugins(),
        &settings,
    );
    assert!(a.refused.is_empty(), "{:?}", a.refused);
    let (config, entry) = rendered(&pool, &a, &members[0]);
    assert_eq!(
        entry.speculation.method,
        gantry_api::config::SpeculationMethod::DraftModel
    );
    assert_eq!(
        entry.speculation.draft_model.as_deref(),
        Some(draft.as_str())
    );
    assert_eq!(entry.speculation.draft_tokens, Some(4));
    assert!(
        config.models.iter().any(|m| m.id == draft),
        "the draft is served by the same pods"
    );
    config
        .validate()
        .expect("the node accepts the pool's config");
}

#[test]
fn a_pool_names_the_isolation_of_the_plugins_its_pods_mount_on_its_pod_hash() {
    let (pool, members) = example();
    let settings = Settings::default();
    let render = |plugins: &[gantry_crd::EnginePlugin]| {
        let template = admit::template(&pool, &settings).expect("template");
        let a = admit::admit(&pool, &template, &members, &[], plugins, &settings);
        admit::render(&pool, &a).expect("render")
    };
    let plain = render(&example_plugins());
    let mut isolated = example_plugins();
    isolated[0].spec.isolation = Some(gantry_api::config::Isolation::Process);
    let rendered = render(&isolated);
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(&rendered.config.yaml).expect("config");
    assert_eq!(
        config.isolation.plugins,
        BTreeMap::from([(
            "llama_cpp".to_string(),
            gantry_api::config::Isolation::Process
        )])
    );
    assert!(!plain.config.yaml.contains("isolation"));
    // Node-wide, opened once per plugin: on the pod template's hash, so the pods roll.
    assert_ne!(rendered.pod_hash, plain.pod_hash);
}

#[test]
fn the_pools_watermark_reaches_its_pods_and_decides_what_fits() {
    let (mut pool, mut members) = example();
    members.push(member("mid", "mid-model", "1500Mi", 3));
    let settings = Settings::default();
    let admit_all = |pool: &ModelPool| {
        let template = admit::template(pool, &settings).expect("template");
        admit::admit(
            pool,
            &template,
            &members,
            &[],
            &example_plugins(),
            &settings,
        )
    };
    // 1500 MiB fits under 90 % of 2 GiB (1843 MiB) ...
    let a = admit_all(&pool);
    assert!(a.member("mid").is_some());
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(&admit::render(&pool, &a).expect("render").config.yaml)
            .expect("config");
    assert_eq!(config.scheduler.memory_watermark_percent, 90);
    // ... not under 70 % (1434 MiB), and the pods are told 70.
    pool.spec.memory_watermark_percent = Some(70);
    let a = admit_all(&pool);
    let refused = a.refusal("mid").expect("refused");
    assert_eq!(refused.reason, "DoesNotFit");
    assert!(refused.message.contains("70 %"), "{}", refused.message);
    let rendered = admit::render(&pool, &a).expect("render");
    let config: gantry_api::NodeConfig =
        serde_yaml::from_str(&rendered.config.yaml).expect("config");
    assert_eq!(config.scheduler.memory_watermark_percent, 70);
    // A node-wide setting: on the pod template's hash, so the pods roll to read it.
    let before = admit::render(&example().0, &admit_all(&example().0)).expect("render");
    assert_ne!(rendered.pod_hash, before.pod_hash);
    // Out of range: the pool is invalid.
    pool.spec.memory_watermark_percent = Some(99 + 1);
    let problems = admit::template(&pool, &settings).expect_err("invalid");
    assert!(
        gantry_operator::model::validate::message(&problems)
            .contains("spec.memoryWatermarkPercent")
    );
}

#[test]
fn the_draft_models_status_comes_from_the_ready_pods_reports() {
    use gantry_api::{DraftStatus as NodeDraft, LoadState, LoadStatus, NodeStatus};
    use gantry_operator::model::resolve::resolve;
    use gantry_operator::model::status::{Facts, fold};
    use gantry_operator::node_report::NodeReport;

    let (_, mut members) = example();
    let draft = members[1].spec.served_name.clone().expect("served name");
    drafts_with(&mut members[0], &draft, None);
    let model = &members[0];
    let settings = Settings::default();
    let v = validate(model, &settings).expect("valid");
    let r = resolve(&v, Some("llama"), &example_plugins(), 1);
    // Two ready pods: one drafts, the other could not load the draft.
    let report = |pod: &str, d: NodeDraft| NodeReport {
        pod: pod.into(),
        config_hash: None,
        plugins: Vec::new(),
        status: Ok(NodeStatus {
            models: vec![gantry_api::ModelStatus {
                id: v.served_name.clone(),
                format: "gguf".into(),
                architecture: Some("llama".into()),
                verdict: None,
                artifact: Default::default(),
                load: LoadStatus {
                    state: LoadState::Loaded,
                    ..Default::default()
                },
                queue: Default::default(),
                devices: Vec::new(),
                replicas: Vec::new(),
                crashes: None,
                engine_choice: None,
                adapters: Vec::new(),
                draft: Some(d),
            }],
            ..NodeStatus::default()
        }),
    };
    let active = report(
        "ml/pool-a",
        NodeDraft {
            model: draft.clone(),
            active: true,
            message: None,
            bytes_used: 1 << 20,
        },
    );
    let inactive = report(
        "ml/pool-b",
        NodeDraft {
            model: draft.clone(),
            active: false,
            message: Some("the draft model tokenizes differently: token 0 ...".into()),
            bytes_used: 0,
        },
    );
    let fold_for = |model: &gantry_crd::Model, reports: &[&NodeReport]| {
        let valid = validate(model, &settings).expect("valid");
        fold(&Facts {
            model,
            valid: &valid,
            architecture: Some("llama"),
            resolution: &r,
            deployment: None,
            reports,
            apply_error: None,
            deliveries: &[],
            deliver_error: None,
            now: crate::support::t0(),
        })
        .draft
    };
    let folded = |reports: &[&NodeReport]| {
        fold_for(model, reports).expect("a Model with a draft model has its status")
    };
    let s = folded(&[&active, &inactive]);
    assert_eq!(
        (s.model.as_str(), s.active_replicas, s.ready_replicas),
        (draft.as_str(), 1, 2)
    );
    assert_eq!(
        s.message.as_deref(),
        Some(
            "node pod ml/pool-b decodes without drafts: the draft model tokenizes differently: token 0 ..."
        )
    );
    let s = folded(&[&active]);
    assert_eq!(
        (s.active_replicas, s.ready_replicas, s.message),
        (1, 1, None)
    );
    // A Model without a draft model has no draft status.
    assert!(fold_for(&members[1], &[]).is_none());
}
