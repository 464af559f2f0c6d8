//! Cache-aware routing keys (on the request path, between reading the body in [`crate::proxy`]
//! and the replica pick in [`crate::route_table`]): which requests should land on the same replica,
//! so that its engine finds their prompt prefix already in its KV cache.
//!
//! The rule, in order (docs/gateway.md, "Routing"):
//! 1. **Session affinity**: a request carrying the session header (`--session-header`,
//!    default `x-gantry-session`) is keyed by its value.
//! 2. **Prefix affinity**: otherwise a chat completion is keyed by its messages up to and
//!    including the first user message (system prompt, few-shot header, the conversation's
//!    opening turn), each message's text cut at `--prefix-chars` characters; a completion by
//!    the first `--prefix-chars` characters of its prompt (a prompt has no turns to tell its
//!    opening from its history). Later turns of one conversation repeat those messages, so
//!    they share the key; conversations that share only a system prompt get different keys
//!    and spread, and each replica caches that system prompt once.
//! 3. Requests without a key (embeddings, empty prompts) and `--routing least-load` go to the
//!    least-loaded replica.
//!
//! A key's replica ([`crate::route_table::RouteTable::pick_keyed`]): the one it last went to
//! ([`crate::placement`]) while that one stays within the load [`Bound`]; otherwise the first
//! replica clockwise from the key's hash on a ring ([`RING_POINTS`] points per replica) that is
//! within the bound and holds no more than its share of the model's live keys. The bound is
//! consistent hashing with bounded load (CHWBL) with an absolute slack: a replica is over it
//! when its load (outstanding + waiting requests) reaches `ceil(load_factor × (total load + 1)
//! / replicas)` *and* exceeds the least-loaded replica's by `--load-slack` or more. Adding or
//! removing a replica moves only the keys it held. Hashes are the first 8 bytes of SHA-256, so
//! every gateway replica (they run active-active) places a new key alike.

use axum::http::{HeaderMap, HeaderName};
use serde::Deserialize;

/// Re-exported from [`crate::hash`], its home since placements use it too.
pub use crate::hash::hash64;

/// Points per replica on the hash ring: enough that three replicas split keys within a few
/// per cent of even (checked by a test), few enough to rebuild the ring on every snapshot.
pub const RING_POINTS: u32 = 160;

/// Default session header.
pub const DEFAULT_SESSION_HEADER: &str = "x-gantry-session";
/// Default characters of a message or prompt that enter the key.
pub const DEFAULT_PREFIX_CHARS: usize = 256;
/// Default bound on a replica's load, as a multiple of the mean (KubeAI's CHWBL default).
pub const DEFAULT_LOAD_FACTOR: f64 = 1.25;
/// Default slack: a replica past the bound keeps a key while its load is less than this many
/// requests above the least-loaded candidate's.
pub const DEFAULT_LOAD_SLACK: u64 = 3;

/// How requests with a key are routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RoutingMode {
    /// Session, then prompt prefix, by consistent hashing with bounded load.
    Prefix,
    /// Least load only (outstanding + waiting), ignoring prefixes and sessions.
    LeastLoad,
}

/// The routing flags (flattened into the gateway's).
#[derive(Clone, Debug, clap::Args)]
pub struct RoutingArgs {
    /// `prefix`: session and prompt-prefix affinity with bounded load; `least-load`: none.
    #[arg(long, env = "GANTRY_GATEWAY_ROUTING", value_enum, default_value_t = RoutingMode::Prefix)]
    pub routing: RoutingMode,
    /// Characters of each chat message (up to the first user message), or of a completion's
    /// prompt, that form a routing key.
    #[arg(long, env = "GANTRY_GATEWAY_PREFIX_CHARS", default_value_t = DEFAULT_PREFIX_CHARS)]
    pub prefix_chars: usize,
    /// A keyed request goes to a replica whose load stays within this multiple of the mean.
    #[arg(long, env = "GANTRY_GATEWAY_LOAD_FACTOR", default_value_t = DEFAULT_LOAD_FACTOR)]
    pub load_factor: f64,
    /// A replica past the load bound still takes a key while its load is less than this many
    /// requests above the least-loaded replica's (0: the bound alone).
    #[arg(long, env = "GANTRY_GATEWAY_LOAD_SLACK", default_value_t = DEFAULT_LOAD_SLACK)]
    pub load_slack: u64,
    /// Seconds a key's placement (the replica it last went to) outlives its last request.
    #[arg(long, env = "GANTRY_GATEWAY_PLACEMENT_TTL_SECONDS", default_value_t = crate::placement::DEFAULT_PLACEMENT_TTL.as_secs())]
    pub placement_ttl_seconds: u64,
    /// Requests carrying this header stick to one replica per header value.
    #[arg(long, env = "GANTRY_GATEWAY_SESSION_HEADER", default_value = DEFAULT_SESSION_HEADER)]
    pub session_header: String,
}

/// The load bound of a keyed pick: a candidate replica is *over* it when its load (outstanding
/// and waiting requests) is at least `ceil(load_factor × (total + 1) / candidates)`
/// ([`load_cap`]) and at least `slack` above the least-loaded candidate's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound {
    /// At least 1.0.
    pub load_factor: f64,
    pub slack: u64,
}

impl Bound {
    /// Whether a replica with `load` is over the bound, given the candidates' `total` and
    /// `min` loads and their `count`.
    pub fn over(&self, load: u64, total: u64, min: u64, count: usize) -> bool {
        load >= load_cap(total, count, self.load_factor) && load >= min.saturating_add(self.slack)
    }
}

/// The routing settings of a running gateway.
#[derive(Clone, Debug)]
pub struct Affinity {
    pub mode: RoutingMode,
    pub prefix_chars: usize,
    pub bound: Bound,
    pub placement_ttl: std::time::Duration,
    pub session_header: Option<HeaderName>,
}

impl Default for Affinity {
    fn default() -> Self {
        Affinity {
            mode: RoutingMode::Prefix,
            prefix_chars: DEFAULT_PREFIX_CHARS,
            bound: Bound {
                load_factor: DEFAULT_LOAD_FACTOR,
                slack: DEFAULT_LOAD_SLACK,
            },
            placement_ttl: crate::placement::DEFAULT_PLACEMENT_TTL,
            session_header: Some(HeaderName::from_static(DEFAULT_SESSION_HEADER)),
        }
    }
}

impl RoutingArgs {
    pub fn affinity(&self) -> Result<Affinity, String> {
        if !(self.load_factor.is_finite() && self.load_factor >= 1.0) {
            return Err(format!(
                "--load-factor must be a number of at least 1.0, got {}",
                self.load_factor
            ));
        }
        if self.prefix_chars == 0 {
            return Err("--prefix-chars must be at least 1".into());
        }
        if self.placement_ttl_seconds == 0 {
            return Err("--placement-ttl-seconds must be at least 1".into());
        }
        let session_header = if self.session_header.is_empty() {
            None
        } else {
            Some(
                HeaderName::try_from(self.session_header.to_ascii_lowercase())
                    .map_err(|e| format!("--session-header {:?}: {e}", self.session_header))?,
            )
        };
        Ok(Affinity {
            mode: self.routing,
            prefix_chars: self.prefix_chars,
            bound: Bound {
                load_factor: self.load_factor,
                slack: self.load_slack,
            },
            placement_ttl: std::time::Duration::from_secs(self.placement_ttl_seconds),
            session_header,
        })
    }
}

/// What a key was made from (the `rule` label of the routing metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    Session,
    Prefix,
}

/// A request's routing key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteKey {
    pub hash: u64,
    pub kind: KeyKind,
}

/// The parts of a request body the key reads.
#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: String,
    #[serde(default)]
    content: Option<serde_json::Value>,
}

/// Appends the text of a message's `content` (a string, or the text parts of an array).
fn push_content(out: &mut String, content: &serde_json::Value) {
    match content {
        serde_json::Value::String(s) => out.push_str(s),
        serde_json::Value::Array(parts) => {
            for p in parts {
                if let Some(t) = p.get("text").and_then(serde_json::Value::as_str) {
                    out.push_str(t);
                }
            }
        }
        _ => {}
    }
}

/// The first `n` characters of `s`.
fn truncate_chars(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The request's routing key, or `None` (least load). `body` is the JSON body the proxy has
/// already checked; a body this cannot read simply has no prefix key.
pub fn route_key(body: &[u8], headers: &HeaderMap, a: &Affinity) -> Option<RouteKey> {
    if a.mode == RoutingMode::LeastLoad {
        return None;
    }
    if let Some(v) = a
        .session_header
        .as_ref()
        .and_then(|h| headers.get(h))
        .filter(|v| !v.as_bytes().is_empty())
    {
        return Some(RouteKey {
            hash: hash64(&[b"session\0", v.as_bytes()]),
            kind: KeyKind::Session,
        });
    }
    let b: Body = serde_json::from_slice(body).ok()?;
    let mut text = String::new();
    if let Some(messages) = &b.messages {
        let mut content = String::new();
        for m in messages {
            content.clear();
            if let Some(c) = &m.content {
                push_content(&mut content, c);
            }
            text.push_str(&m.role);
            text.push('\0');
            text.push_str(truncate_chars(&content, a.prefix_chars));
            text.push('\0');
            if m.role == "user" {
                break;
            }
        }
        return Some(RouteKey {
            hash: hash64(&[b"chat\0", text.as_bytes()]),
            kind: KeyKind::Prefix,
        });
    } else {
        match &b.prompt {
            Some(serde_json::Value::String(p)) => text.push_str(p),
            // A batch of prompts: keyed by the first.
            Some(serde_json::Value::Array(ps)) => {
                if let Some(serde_json::Value::String(p)) = ps.first() {
                    text.push_str(p);
                }
            }
            _ => {}
        }
    }
    if text.is_empty() {
        return None;
    }
    let prefix = truncate_chars(&text, a.prefix_chars);
    Some(RouteKey {
        hash: hash64(&[b"prefix\0", prefix.as_bytes()]),
        kind: KeyKind::Prefix,
    })
}

/// A hash ring over a model's replicas: `RING_POINTS` points per replica, sorted.
#[derive(Debug, Default)]
pub struct Ring {
    /// (point, replica index).
    points: Vec<(u64, usize)>,
}

impl Ring {
    /// The ring of replicas named by their URLs, in the order given.
    pub fn new<'a>(urls: impl IntoIterator<Item = &'a str>) -> Ring {
        let mut points = Vec::new();
        for (i, url) in urls.into_iter().enumerate() {
            for p in 0..RING_POINTS {
                points.push((hash64(&[url.as_bytes(), b"#", &p.to_be_bytes()]), i));
            }
        }
        points.sort_unstable();
        Ring { points }
    }

    /// Replica indices clockwise from `hash`, each once.
    pub fn walk(&self, hash: u64, n_replicas: usize) -> Vec<usize> {
        let start = self.points.partition_point(|&(p, _)| p < hash);
        let mut seen = vec![false; n_replicas];
        let mut out = Vec::with_capacity(n_replicas);
        for k in 0..self.points.len() {
            let (_, i) = self.points[(start + k) % self.points.len()];
            if i < n_replicas && !seen[i] {
                seen[i] = true;
                out.push(i);
                if out.len() == n_replicas {
                    break;
                }
            }
        }
        out
    }
}

/// The bounded-load cap: a replica may take a keyed request while its load stays at or below
/// `ceil(load_factor × (total + 1) / replicas)`.
pub fn load_cap(total_load: u64, replicas: usize, load_factor: f64) -> u64 {
    if replicas == 0 {
        return 0;
    }
    ((total_load + 1) as f64 * load_factor / replicas as f64).ceil() as u64
}

#[cfg(test)]
mod tests;
