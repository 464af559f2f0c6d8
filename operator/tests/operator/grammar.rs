//! The Kubernetes grammars the Model validation step uses (first step of a reconcile).

use gantry_operator::model::validate::{is_dns1035_label, is_quantity, is_resource_name};

#[test]
fn quantities_follow_the_kubernetes_grammar() {
    for ok in [
        "1", "8Gi", "500m", "0.5", ".5", "1e3", "1E-2", "+2k", "1.5Gi", "12Mi",
    ] {
        assert!(is_quantity(ok), "{ok} should parse");
    }
    for bad in ["", "lots", "8GB", "1.2.3", "Gi", "1e", "1ee3", "--1", "."] {
        assert!(!is_quantity(bad), "{bad} should not parse");
    }
}

#[test]
fn names_follow_dns_rules() {
    assert!(is_dns1035_label("gemma-3"));
    assert!(!is_dns1035_label("3gemma"));
    assert!(!is_dns1035_label("gemma.3"));
    assert!(!is_dns1035_label(&"a".repeat(64)));
    assert!(is_resource_name("nvidia.com/gpu"));
    assert!(!is_resource_name("nvidia.com/"));
}
