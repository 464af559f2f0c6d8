//! End-to-end test support (outside the request path): the workspace-level tests live in `tests/`.
#![forbid(unsafe_code)]
