//! End-to-end test support (outside the request path): locating built binaries and plugins.
#![forbid(unsafe_code)]
