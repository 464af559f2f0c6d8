//! The operator's command line (before any reconcile): flags parse into the settings the
//! controller and gateway start with.

use clap::CommandFactory;
use clap::Parser as _;
use gantry_operator::cli::{Cli, Command, Component};

#[test]
fn the_command_line_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn components_default_to_both_and_parse_a_list() {
    let parse = |args: &[&str]| match Cli::try_parse_from(args).expect("parses").command {
        Command::Run(run) => run.components,
        Command::Crdgen { .. } | Command::Rbac { .. } => panic!("not run"),
    };
    assert_eq!(
        parse(&["gantry-operator", "run"]),
        [Component::Controller, Component::Gateway]
    );
    assert_eq!(
        parse(&["gantry-operator", "run", "--components", "gateway"]),
        [Component::Gateway]
    );
    assert!(
        Cli::try_parse_from(["gantry-operator", "run", "--components", "gateway,router"]).is_err()
    );
}

#[test]
fn network_policy_flags_become_the_per_model_policy_settings() {
    let run = |args: &[&str]| match Cli::try_parse_from(args).expect("parses").command {
        Command::Run(run) => run,
        Command::Crdgen { .. } | Command::Rbac { .. } => panic!("not run"),
    };
    assert_eq!(run(&["gantry-operator", "run"]).node_network_policy(), None);
    let r = run(&[
        "gantry-operator",
        "run",
        "--node-network-policy",
        "--lease-namespace",
        "ops",
        "--network-policy-peer-labels",
        "app.kubernetes.io/name=gantry,app.kubernetes.io/instance=prod",
        "--network-policy-metrics-namespace",
        "monitoring",
    ]);
    let p = r.node_network_policy().expect("on");
    assert_eq!(p.peer_namespace, "ops");
    assert_eq!(
        p.peer_labels
            .get("app.kubernetes.io/instance")
            .map(String::as_str),
        Some("prod")
    );
    assert_eq!(p.metrics_namespace.as_deref(), Some("monitoring"));
    assert!(p.download_cidrs.is_empty());
    assert!(
        Cli::try_parse_from(["gantry-operator", "run", "--node-token", "short"]).is_err(),
        "a weak install token is refused at start"
    );
}
