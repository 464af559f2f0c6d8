//! CRD generation (outside the reconcile path: `gantry-operator crdgen` and the CRD tests): the
//! YAML written to `crds/` and `charts/gantry/crds/` from the `gantry-crd` types, and the
//! structural-schema checker the apiserver's rules are tested with.

pub mod generate;
pub mod structural;
