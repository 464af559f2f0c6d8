//! Custom resources in the operator (outside the reconcile path: `gantry-operator crdgen` and the
//! CRD tests): the CRD generator and the structural-schema checker.
//!
//! The types themselves live in `gantry-crd`, shared with the gateway; they are re-exported here
//! so every reconcile step names them `crate::crd::Model`.

pub mod generate;
pub mod structural;

pub use gantry_crd::*;
