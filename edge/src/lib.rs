//! The network edge (the first step of every request, on the node and on the gateway): the
//! accept loop with its connection cap and timeouts, the file-descriptor limit, and the layers
//! every response passes through (request id, OpenAI-shaped refusals, content type).
//!
//! Both servers call [`serve`] with their axum `Router` after [`layers`] has wrapped it, and
//! take their limits from one set of flags, [`EdgeArgs`], so the node and the gateway agree on
//! the body limit and on how long a client may hold a connection:
//!
//! - **header-read timeout**: a request's headers must arrive within
//!   `--header-read-timeout-seconds` of its first byte (slowloris);
//! - **idle timeout**: a connection with no request in flight and no byte received is closed
//!   after `--idle-timeout-seconds` (keep-alive and never-used connections alike);
//! - **body-read timeout**: a request's body must arrive within `--body-read-timeout-seconds`
//!   of its headers (a slow body is a request in flight, which the idle rules never close);
//! - **connection cap**: at `--max-connections` open connections, a new one first closes the
//!   longest-idle connection; when every connection has a request in flight, the new one gets
//!   a 503 in OpenAI's error shape and is closed.
//!
//! Hyper's own `header_read_timeout` also starts while a keep-alive connection waits for its
//! next request, so it cannot tell "slow headers" from "idle"; the two timers here can.

mod conn;
mod layers;

use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

pub use conn::serve;
pub use layers::{RequestId, X_REQUEST_ID, layers};

/// Largest request body the node and the gateway accept, one setting for both (a body the
/// gateway accepts is never refused by the node for its size).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;

/// Connection limits and the body limit, shared by the node and the gateway.
#[derive(clap::Args, Clone, Debug, PartialEq, Eq)]
pub struct EdgeArgs {
    /// Most open client connections. At the cap a new connection closes the longest-idle one;
    /// when all have a request in flight it gets a 503 and is closed.
    #[arg(long, env = "GANTRY_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers once its first byte arrived.
    #[arg(long, env = "GANTRY_HEADER_READ_TIMEOUT_SECONDS", default_value_t = 10)]
    pub header_read_timeout_seconds: u64,
    /// Seconds a connection may stay open with no request in flight (keep-alive idle).
    #[arg(long, env = "GANTRY_IDLE_TIMEOUT_SECONDS", default_value_t = 60)]
    pub idle_timeout_seconds: u64,
    /// Seconds a request's body has to arrive once its headers did (slow bodies).
    #[arg(long, env = "GANTRY_BODY_READ_TIMEOUT_SECONDS", default_value_t = 60)]
    pub body_read_timeout_seconds: u64,
    /// Largest request body in bytes (the node and the gateway use the same default).
    #[arg(long, env = "GANTRY_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
}

impl Default for EdgeArgs {
    fn default() -> Self {
        EdgeArgs {
            max_connections: 4096,
            header_read_timeout_seconds: 10,
            idle_timeout_seconds: 60,
            body_read_timeout_seconds: 60,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

impl EdgeArgs {
    fn header_read_timeout(&self) -> Duration {
        Duration::from_secs(self.header_read_timeout_seconds.max(1))
    }
    fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.idle_timeout_seconds.max(1))
    }
    fn body_read_timeout(&self) -> Duration {
        Duration::from_secs(self.body_read_timeout_seconds.max(1))
    }
}

/// The edge's metrics, registered in the server's own registry under its prefix
/// (`gantry` on the node, `gantry_gateway` on the gateway).
#[derive(Clone, Debug)]
pub struct EdgeMetrics {
    pub open: IntGauge,
    pub accepted: IntCounter,
    pub refused: IntCounter,
    pub closed: IntCounterVec,
}

impl EdgeMetrics {
    pub fn register(registry: &Registry, prefix: &str) -> prometheus::Result<Self> {
        let m = EdgeMetrics {
            open: IntGauge::with_opts(Opts::new(
                format!("{prefix}_connections_open"),
                "Client connections open now",
            ))?,
            accepted: IntCounter::with_opts(Opts::new(
                format!("{prefix}_connections_accepted_total"),
                "Client connections accepted",
            ))?,
            refused: IntCounter::with_opts(Opts::new(
                format!("{prefix}_connections_refused_total"),
                "Connections refused with a 503 at the connection cap (every connection busy)",
            ))?,
            closed: IntCounterVec::new(
                Opts::new(
                    format!("{prefix}_connections_closed_total"),
                    "Connections the server closed, by reason: header_timeout, idle_timeout, evicted (idle, at the cap)",
                ),
                &["reason"],
            )?,
        };
        registry.register(Box::new(m.open.clone()))?;
        registry.register(Box::new(m.accepted.clone()))?;
        registry.register(Box::new(m.refused.clone()))?;
        registry.register(Box::new(m.closed.clone()))?;
        for reason in conn::CLOSE_REASONS {
            m.closed.with_label_values(&[reason]);
        }
        Ok(m)
    }

    /// The metric family names, for the tests that check dashboards and docs against them
    /// (read from the collectors themselves, so they cannot drift from what is registered).
    pub fn family_names(&self) -> Vec<String> {
        use prometheus::core::Collector;
        let collectors: [&dyn Collector; 4] =
            [&self.open, &self.accepted, &self.refused, &self.closed];
        collectors
            .iter()
            .flat_map(|c| c.desc())
            .map(|d| d.fq_name.clone())
            .collect()
    }
}

/// Raise the soft `RLIMIT_NOFILE` to the hard limit (a server holds one descriptor per
/// connection; the usual soft default of 1024 is far below what the connection cap allows).
/// Returns the soft limit in force afterwards.
pub fn raise_nofile_limit() -> std::io::Result<u64> {
    rlimit::increase_nofile_limit(u64::MAX)
}

/// Raise the descriptor limit and say what it is, warning when the connection cap cannot be
/// reached with it.
pub fn prepare(args: &EdgeArgs) {
    match raise_nofile_limit() {
        Ok(n) => {
            tracing::info!(
                nofile = n,
                max_connections = args.max_connections,
                "file descriptor limit"
            );
            if (args.max_connections as u64).saturating_add(256) > n {
                tracing::warn!(
                    nofile = n,
                    max_connections = args.max_connections,
                    "the connection cap is close to the file descriptor limit; lower --max-connections"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not raise the file descriptor limit"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        edge: EdgeArgs,
    }

    #[test]
    fn the_default_is_what_the_flags_default_to() {
        let parsed = Flags::try_parse_from(["x"]).expect("parse").edge;
        assert_eq!(parsed, EdgeArgs::default());
    }
}
