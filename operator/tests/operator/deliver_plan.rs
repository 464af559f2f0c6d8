//! In-place plugin delivery, pure (build and deliver steps): which image changes the build step
//! holds back so nothing rolls and which roll the pods, and the plan's pacing (one pod first, then
//! a quarter at a time) and halting.

use gantry_api::config::Isolation;
use gantry_crd::{EnginePlugin, Model};
use gantry_operator::context::{PluginDelivery, Settings};
use gantry_operator::model::build::{self, OwnedObjects};
use gantry_operator::model::deliver::{Delivery, PodState, Slot, plan};

use crate::deliver::{IMAGE_V1, IMAGE_V2, SLOT, built, plugins_at};
use crate::reconcile::{example_model, example_plugins};

// --- the build step: which image changes roll and which do not ---

#[test]
fn a_new_image_of_a_process_plugin_keeps_the_live_template_so_nothing_rolls() {
    let m = example_model();
    let live = built(&m, &plugins_at("0.1.0"));
    let mut next = built(&m, &plugins_at("0.2.0"));
    assert_ne!(
        live.deployment, next.deployment,
        "the image is in the template"
    );
    let annotations = next
        .deployment
        .metadata
        .annotations
        .clone()
        .unwrap_or_default();
    assert_eq!(
        annotations["gantry.dev/plugin-images"],
        format!("{{\"{SLOT}\":\"{IMAGE_V2}\"}}")
    );

    let held = build::hold_plugin_images(&mut next, Some(&live.deployment)).expect("hold");
    assert!(held);
    // Exactly what runs: same hash, same template, so the apply step writes nothing.
    assert_eq!(next.deployment, live.deployment);
    assert_eq!(template_plugin_image(&next), Some(IMAGE_V1));
}

/// The image of the plugin init container in `o`'s pod template.
fn template_plugin_image(o: &OwnedObjects) -> Option<&str> {
    o.deployment
        .spec
        .template
        .spec
        .as_ref()?
        .init_containers
        .as_ref()?[0]
        .image
        .as_deref()
}

/// The objects for `m` with `plugins` under operator `settings`.
fn build_with(m: &Model, plugins: &[EnginePlugin], settings: &Settings) -> OwnedObjects {
    let v = gantry_operator::model::validate::validate(m, settings).expect("valid");
    let refs: Vec<&EnginePlugin> = plugins.iter().collect();
    build::build(&v, &refs, settings).expect("build")
}

#[test]
fn any_other_change_rolls_the_pods_with_the_new_image_in_the_new_template() {
    let m = example_model();
    let live = built(&m, &plugins_at("0.1.0"));
    // A new node image (an operator upgrade) and a new plugin version at once: one rollout.
    let settings = Settings {
        node_image: "ghcr.io/gantry-dev/gantry-node:0.2.0".into(),
        ..Settings::default()
    };
    let mut next = build_with(&m, &plugins_at("0.2.0"), &settings);
    let before = next.clone();
    assert!(!build::hold_plugin_images(&mut next, Some(&live.deployment)).expect("hold"));
    assert_eq!(next, before);
    assert_eq!(template_plugin_image(&next), Some(IMAGE_V2));
}

#[test]
fn an_in_process_plugin_or_rollout_delivery_rolls_for_a_new_image() {
    let m = example_model();
    // In-process: the node cannot replace its code, so the new image goes into the template.
    let mut v1 = example_plugins();
    let mut v2 = example_plugins();
    v2[0].spec.image = IMAGE_V2.into();
    v2[0].spec.version = "0.2.0".into();
    v1[0].spec.isolation = Some(Isolation::InProcess);
    v2[0].spec.isolation = Some(Isolation::InProcess);
    let live = built(&m, &v1);
    let mut next = built(&m, &v2);
    assert!(!build::hold_plugin_images(&mut next, Some(&live.deployment)).expect("hold"));
    let annotations = next
        .deployment
        .metadata
        .annotations
        .clone()
        .unwrap_or_default();
    assert!(
        !annotations.contains_key("gantry.dev/plugin-images"),
        "no plugin-images annotation for in-process plugins: {annotations:?}"
    );

    // `--plugin-delivery rollout`: the same for a process plugin.
    let settings = Settings {
        plugin_delivery: PluginDelivery::Rollout,
        ..Settings::default()
    };
    let live = build_with(&m, &plugins_at("0.1.0"), &settings);
    let mut next = build_with(&m, &plugins_at("0.2.0"), &settings);
    assert!(!build::hold_plugin_images(&mut next, Some(&live.deployment)).expect("hold"));
}

// --- the plan: pacing and halting ---

fn slot_of(plugins: &[EnginePlugin]) -> Slot<'_> {
    Slot {
        container: SLOT.into(),
        plugin: &plugins[0],
    }
}

fn stale(serving: bool) -> PodState {
    PodState::Stale {
        serving,
        ordinal: 0,
    }
}

fn named(states: Vec<PodState>) -> Vec<(String, PodState)> {
    states
        .into_iter()
        .enumerate()
        .map(|(i, s)| (format!("p{i}"), s))
        .collect()
}

fn pods_sent(sends: &[Delivery]) -> Vec<&str> {
    sends.iter().map(|s| s.pod.as_str()).collect()
}

#[test]
fn one_pod_goes_first_and_the_rest_wait_for_it() {
    let plugins = plugins_at("0.2.0");
    let slot = slot_of(&plugins);
    let (sends, progress) = plan(&slot, &named(vec![stale(true), stale(true), stale(true)]));
    assert_eq!(pods_sent(&sends), ["p0"]);
    assert_eq!(sends[0].container, format!("{SLOT}-u1"));
    assert_eq!((progress.done, progress.pods), (0, 3));
    assert!(progress.delivering());
    // While it is on its way, nobody else goes.
    let (sends, _) = plan(
        &slot,
        &named(vec![PodState::InFlight, stale(true), stale(true)]),
    );
    assert!(sends.is_empty());
}

#[test]
fn after_the_first_success_a_quarter_goes_at_a_time_and_only_to_serving_pods() {
    let plugins = plugins_at("0.2.0");
    let slot = slot_of(&plugins);
    // 9 pods: a quarter is 3; one is in flight, so two more go. The pod not serving yet (its
    // init container may still copy the older image) waits; so would one still copying.
    let mut states = vec![
        PodState::Done,
        PodState::InFlight,
        PodState::Stale {
            serving: false,
            ordinal: 0,
        },
        PodState::Stale {
            serving: true,
            ordinal: 2,
        },
    ];
    states.extend((0..5).map(|_| stale(true)));
    let (sends, progress) = plan(&slot, &named(states));
    assert_eq!(pods_sent(&sends), ["p3", "p4"]);
    assert_eq!(
        sends[0].container,
        format!("{SLOT}-u3"),
        "numbered after its last delivery"
    );
    assert_eq!((progress.done, progress.pods), (1, 9));

    let (sends, progress) = plan(&slot, &named(vec![PodState::Done, PodState::Done]));
    assert!(sends.is_empty());
    assert!(!progress.delivering());
}

#[test]
fn a_failed_pod_halts_the_delivery() {
    let plugins = plugins_at("0.2.0");
    let slot = slot_of(&plugins);
    let states = named(vec![
        PodState::Failed("its node refused: bad ABI".into()),
        stale(true),
        stale(false),
    ]);
    let (sends, progress) = plan(&slot, &states);
    assert!(sends.is_empty());
    assert_eq!(
        progress.halted,
        Some(("p0".to_string(), "its node refused: bad ABI".to_string()))
    );
    assert!(!progress.delivering());
}
