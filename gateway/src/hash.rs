//! Routing hashes (on the request path, under both the routing key of [`crate::affinity`] and
//! the placement memory of [`crate::placement`]): one 64-bit hash for keys, ring points and
//! model ids.
//!
//! The first 8 bytes of SHA-256, so every gateway replica (they run active-active) hashes a
//! key, and so places it, alike. Its own module so that the keys and the placements both
//! depend on it rather than on each other.

use sha2::{Digest, Sha256};

/// The first 8 bytes of SHA-256, big-endian.
pub fn hash64(parts: &[&[u8]]) -> u64 {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_be_bytes(b)
}
