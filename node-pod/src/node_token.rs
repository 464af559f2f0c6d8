//! The token a node pod requires (set at start-up by `cli`, held by `node`, checked by the HTTP
//! layer's `http/node_auth.rs` before anything else).
//!
//! The comparison is over SHA-256 digests with a constant-time equality, so the time taken says
//! nothing about how much of a guess, or how long a prefix of it, was right.

use gantry_api::node_token::{MIN_INSTALL_TOKEN_LEN, NODE_TOKEN_ENV};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The token this node requires, kept only as its digest. `Debug` never prints it.
#[derive(Clone)]
pub struct NodeToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for NodeToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeToken(<redacted>)")
    }
}

/// Why the configured token was refused at start-up.
#[derive(Debug, thiserror::Error)]
pub enum NodeTokenError {
    #[error(
        "{NODE_TOKEN_ENV} must be at least {MIN_INSTALL_TOKEN_LEN} visible ASCII characters \
         (got {0}); unset it to serve without a token"
    )]
    Weak(usize),
}

impl NodeToken {
    /// The `--node-token` setting: `None` serves without a check. A token that is set but empty
    /// or short is refused (a broken Secret must not open the node).
    pub fn from_setting(value: Option<&str>) -> Result<Option<Self>, NodeTokenError> {
        let Some(value) = value else {
            return Ok(None);
        };
        let token = value.trim();
        if token.len() < MIN_INSTALL_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(NodeTokenError::Weak(token.len()));
        }
        Ok(Some(NodeToken {
            digest: Sha256::digest(token.as_bytes()).into(),
        }))
    }

    /// Whether `presented` is the token, in time independent of where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let d: [u8; 32] = Sha256::digest(presented).into();
        bool::from(self.digest.ct_eq(&d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_matches_only_itself_and_a_weak_one_is_refused() {
        let t = NodeToken::from_setting(Some("0123456789abcdef0123456789abcdef\n"))
            .expect("valid")
            .expect("set");
        assert!(t.matches(b"0123456789abcdef0123456789abcdef"));
        assert!(!t.matches(b"0123456789abcdef0123456789abcde"));
        assert!(!t.matches(b""));
        assert!(!format!("{t:?}").contains("0123"));
        assert!(NodeToken::from_setting(None).expect("unset").is_none());
        assert!(NodeToken::from_setting(Some("")).is_err());
        assert!(NodeToken::from_setting(Some("short")).is_err());
    }
}
