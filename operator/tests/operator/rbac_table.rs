//! The RBAC table's own invariants (outside the reconcile path): sorted verbs, nothing that
//! escalates, name-limited rules.

use gantry_operator::rbac::Component::{Controller, Gateway};
use gantry_operator::rbac::Scope::Cluster;
use gantry_operator::rbac::{LEASE_NAME, Names, RULES, Scope, allows, to_markdown};

#[test]
fn verbs_are_sorted_unique_and_never_escalating() {
    for r in RULES {
        let mut sorted = r.verbs.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted, r.verbs,
            "{} {}: verbs unsorted or repeated",
            r.group, r.resource
        );
        for bad in ["*", "escalate", "bind", "impersonate"] {
            assert!(!r.verbs.contains(&bad), "{}: grants {bad}", r.resource);
        }
        assert_ne!(r.resource, "pods/exec");
        // Secrets are never listed or watched (no bulk read): the gateway gets the API-key
        // Secret by name, the controller gets and applies the node-token Secrets it owns.
        if r.resource == "secrets" {
            assert!(!r.verbs.contains(&"list") && !r.verbs.contains(&"watch"));
            match r.component {
                Gateway => {
                    assert_eq!(r.names, Names::ApiKeysSecret);
                    assert_eq!(r.scope, Scope::OperatorNamespace);
                }
                Controller => assert_eq!(r.verbs, ["create", "get", "patch"]),
            }
        }
    }
}

#[test]
fn name_limited_rules_do_not_cover_collections_or_other_names() {
    let names = |n: Names| match n {
        Names::ApiKeysSecret => Some("keys".to_string()),
        Names::LeaderLease => Some(LEASE_NAME.to_string()),
        Names::Any => None,
    };
    let ns = Scope::OperatorNamespace;
    assert!(allows(
        Gateway,
        ns,
        "",
        "secrets",
        "get",
        Some("keys"),
        names
    ));
    assert!(!allows(
        Gateway,
        ns,
        "",
        "secrets",
        "get",
        Some("other"),
        names
    ));
    assert!(!allows(Gateway, ns, "", "secrets", "list", None, names));
    assert!(!allows(
        Gateway,
        Cluster,
        "",
        "secrets",
        "get",
        Some("keys"),
        names
    ));
    assert!(allows(
        Controller,
        ns,
        "coordination.k8s.io",
        "leases",
        "create",
        None,
        names
    ));
    assert!(!allows(
        Controller,
        ns,
        "coordination.k8s.io",
        "leases",
        "update",
        Some("x"),
        names
    ));
    // A cluster-wide rule covers a request in the operator's namespace too.
    assert!(allows(
        Controller,
        ns,
        "apps",
        "deployments",
        "patch",
        Some("m"),
        names
    ));
    assert!(!allows(
        Gateway,
        Cluster,
        "apps",
        "deployments",
        "delete",
        Some("m"),
        names
    ));
}

#[test]
fn markdown_has_a_row_per_rule() {
    assert_eq!(to_markdown().lines().count(), RULES.len() + 2);
}
