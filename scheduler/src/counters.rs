//! The engine's own event counters (scheduler thread, between steps; ABI 1.12
//! `model_counters`): read about once a second from the engine this scheduler owns and added
//! to `gantry_engine_events_total{model, event}` as the increase since the last read, so the
//! series of a model's replicas sum and a restarted engine starts from zero again.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::engine::Engine;
use crate::metrics::SchedulerMetrics;

/// How often the engine is asked.
const EVERY: Duration = Duration::from_secs(1);

/// What the last read saw.
#[derive(Default)]
pub(crate) struct Polled {
    last: HashMap<String, u64>,
    at: Option<Instant>,
}

impl Polled {
    /// Read the engine's counters if a second has passed, and count what grew.
    pub(crate) fn poll(&mut self, engine: &mut impl Engine, metrics: &SchedulerMetrics) {
        if self.at.is_some_and(|at| at.elapsed() < EVERY) {
            return;
        }
        self.at = Some(Instant::now());
        for (name, grew) in self.increases(engine.counters()) {
            metrics
                .engine_events
                .with_label_values(&[&metrics.model, &name])
                .inc_by(grew);
        }
    }

    /// What grew since the last read, counter by counter (only those that did).
    fn increases(&mut self, now: Vec<(String, u64)>) -> Vec<(String, u64)> {
        now.into_iter()
            .filter_map(|(name, value)| {
                let before = self.last.insert(name.clone(), value).unwrap_or(0);
                // A counter that went down was reset by the engine: all of it is new.
                let grew = if value >= before {
                    value - before
                } else {
                    value
                };
                (grew > 0).then_some((name, grew))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::Polled;

    #[test]
    fn each_read_counts_what_grew_and_a_reset_counts_from_zero() {
        let c = |pairs: &[(&str, u64)]| -> Vec<(String, u64)> {
            pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
        };
        let mut p = Polled::default();
        assert_eq!(
            p.increases(c(&[("graph_builds", 2), ("graph_reuses", 0)])),
            c(&[("graph_builds", 2)])
        );
        assert_eq!(
            p.increases(c(&[("graph_builds", 3), ("graph_reuses", 40)])),
            c(&[("graph_builds", 1), ("graph_reuses", 40)])
        );
        // A name missing from a read keeps its last value; one that went down was reset.
        assert_eq!(
            p.increases(c(&[("graph_reuses", 41)])),
            c(&[("graph_reuses", 1)])
        );
        assert_eq!(
            p.increases(c(&[("graph_builds", 1)])),
            c(&[("graph_builds", 1)])
        );
    }
}
