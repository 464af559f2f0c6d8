//! The built-in autoscaler (beside the reconcile path), its settings: the command-line flags
//! `gantry-operator run` flattens in, and the config `autoscale::run` runs with.

use std::time::Duration;

/// The autoscaler's command-line flags (flattened into `gantry-operator run`).
#[derive(Clone, Debug, clap::Args)]
pub struct AutoscalerArgs {
    /// Run the built-in autoscaler on the leader (`false`: Builtin-mode Deployments keep the
    /// count they were created with, or whatever `kubectl scale` sets).
    #[arg(long = "autoscaler", env = "GANTRY_AUTOSCALER", default_value_t = true, action = clap::ArgAction::Set)]
    pub autoscaler: bool,
    /// Seconds between two autoscaler decisions.
    #[arg(long, env = "GANTRY_AUTOSCALER_INTERVAL_SECONDS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=300))]
    pub autoscaler_interval_seconds: u64,
    /// Milliseconds to wait for one node pod's status before counting it as silent.
    #[arg(long, env = "GANTRY_AUTOSCALER_METRICS_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=30000))]
    pub autoscaler_metrics_timeout_ms: u64,
}

impl AutoscalerArgs {
    /// `None` when the autoscaler is switched off.
    pub fn config(&self) -> Option<AutoscalerConfig> {
        self.autoscaler.then(|| AutoscalerConfig {
            interval: Duration::from_secs(self.autoscaler_interval_seconds),
            metrics_timeout: Duration::from_millis(self.autoscaler_metrics_timeout_ms),
        })
    }
}

/// How the autoscaler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutoscalerConfig {
    pub interval: Duration,
    /// Per node pod status request.
    pub metrics_timeout: Duration,
}

impl Default for AutoscalerConfig {
    fn default() -> Self {
        AutoscalerConfig {
            interval: Duration::from_secs(5),
            metrics_timeout: Duration::from_secs(1),
        }
    }
}
