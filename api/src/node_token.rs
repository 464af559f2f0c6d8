//! Node tokens (the first check of every request a node pod serves, and the header the gateway
//! and the operator add to every call they make to one): who may talk to a node pod.
//!
//! One random install token lives in a Secret in the operator's namespace (`GANTRY_NODE_TOKEN`
//! of the operator and the gateway). A Model's node pods get their own token derived from it,
//! `hex(HMAC-SHA256(install token, "<namespace>/<model name>"))`, through a Secret the operator
//! writes next to the Model. A node pod, or anyone who can read its namespace's Secrets, thus
//! learns only the token of that one Model, never the install token or another Model's.
//! The derivation lives here, once, so the operator (which writes the Secret and calls
//! `/v1/status`) and the gateway (which proxies) cannot disagree about it.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The request header that carries the token to a node pod.
pub const NODE_TOKEN_HEADER: &str = "x-gantry-node-token";
/// The environment variable that holds a token: the install token in the operator and the
/// gateway, the Model's derived token in a node pod.
pub const NODE_TOKEN_ENV: &str = "GANTRY_NODE_TOKEN";
/// The key of the token in its Secret (the install Secret and each Model's).
pub const NODE_TOKEN_SECRET_KEY: &str = "token";
/// The shortest install token accepted: 128 bits of hex, or 22 random alphanumerics, at least.
pub const MIN_INSTALL_TOKEN_LEN: usize = 32;

/// Why an install token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error(
        "the node token must be at least {MIN_INSTALL_TOKEN_LEN} characters, got {0}; \
         generate one with `openssl rand -hex 32`"
    )]
    TooShort(usize),
    #[error("the node token must be visible ASCII (it travels in an HTTP header)")]
    NotAscii,
}

/// The per-install secret every Model's node token is derived from. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct InstallToken(String);

impl std::fmt::Debug for InstallToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InstallToken(<redacted>)")
    }
}

impl std::str::FromStr for InstallToken {
    type Err = TokenError;

    /// Surrounding whitespace (a trailing newline from `kubectl create secret --from-file`)
    /// is not part of the token.
    fn from_str(s: &str) -> Result<Self, TokenError> {
        let s = s.trim();
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotAscii);
        }
        if s.len() < MIN_INSTALL_TOKEN_LEN {
            return Err(TokenError::TooShort(s.len()));
        }
        Ok(InstallToken(s.to_string()))
    }
}

/// The token one node pod requires (a Model's, or the install token itself for nodes started by
/// hand). `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct ModelToken(String);

impl std::fmt::Debug for ModelToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ModelToken(<redacted>)")
    }
}

impl ModelToken {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl InstallToken {
    /// The install token itself as a node token: what a node started by hand with
    /// `GANTRY_NODE_TOKEN=<install token>` requires (the gateway's static endpoints file).
    pub fn as_node_token(&self) -> ModelToken {
        ModelToken(self.0.clone())
    }

    /// The node token of Model `name` in `namespace`: 64 lowercase hex digits.
    pub fn for_model(&self, namespace: &str, name: &str) -> ModelToken {
        // HMAC accepts a key of any length, so `new_from_slice` cannot fail.
        let mut mac = match Hmac::<Sha256>::new_from_slice(self.0.as_bytes()) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC takes keys of any length"),
        };
        mac.update(namespace.as_bytes());
        mac.update(b"/");
        mac.update(name.as_bytes());
        ModelToken(hex::encode(mac.finalize().into_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> InstallToken {
        "0123456789abcdef0123456789abcdef".parse().expect("token")
    }

    #[test]
    fn derivation_is_hmac_sha256_of_namespace_slash_name() {
        // Computed independently: python3 -c 'import hmac, hashlib; print(hmac.new(
        //   b"0123456789abcdef0123456789abcdef", b"team-a/gemma", hashlib.sha256).hexdigest())'
        assert_eq!(
            token().for_model("team-a", "gemma").as_str(),
            "4dce9168474a782aeebad355ce9572b8e237d58baa22a8c071bdd293110b3ba2"
        );
    }

    #[test]
    fn each_model_and_namespace_gets_its_own_token() {
        let t = token();
        let a = t.for_model("team-a", "gemma");
        assert_ne!(a, t.for_model("team-b", "gemma"));
        assert_ne!(a, t.for_model("team-a", "gemma2"));
        // The separator keeps `a/bc` and `ab/c` apart.
        assert_ne!(t.for_model("a", "bc"), t.for_model("ab", "c"));
        let other: InstallToken = "fedcba9876543210fedcba9876543210".parse().expect("token");
        assert_ne!(a, other.for_model("team-a", "gemma"));
    }

    #[test]
    fn short_or_non_ascii_tokens_are_refused_and_debug_hides_the_token() {
        assert_eq!(
            "short".parse::<InstallToken>(),
            Err(TokenError::TooShort(5))
        );
        assert_eq!(
            "0123456789abcdef 0123456789abcdef".parse::<InstallToken>(),
            Err(TokenError::NotAscii)
        );
        let t: InstallToken = "0123456789abcdef0123456789abcdef\n"
            .parse()
            .expect("trimmed");
        assert_eq!(
            t.as_node_token().as_str(),
            "0123456789abcdef0123456789abcdef"
        );
        assert!(!format!("{t:?}").contains("0123"));
        assert!(!format!("{:?}", t.for_model("a", "b")).contains(t.for_model("a", "b").as_str()));
    }
}
