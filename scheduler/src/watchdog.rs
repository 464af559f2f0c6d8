//! The step watchdog (beside each scheduler thread): reads the start time of the step in
//! flight and acts when one overruns its limit.
//!
//! A hung in-process plugin cannot be interrupted; failing `/healthz` lets Kubernetes restart
//! the pod, as the specification asks. A hung plugin in a worker is killed, and only its
//! model restarts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::engine::Overrun;
use crate::handle::Figures;
use crate::metrics::SchedulerMetrics;

/// Watch one replica's steps until its figures are dropped (the scheduler ended).
pub(crate) fn spawn(
    figures: &Arc<Figures>,
    epoch: Instant,
    limit: Duration,
    overrun: Overrun,
    hung: Arc<AtomicBool>,
    metrics: SchedulerMetrics,
) -> std::io::Result<()> {
    let weak = Arc::downgrade(figures);
    let model = metrics.model.clone();
    std::thread::Builder::new().name(format!("watchdog-{model}")).spawn(move || {
        let tick = (limit / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
        while let Some(f) = weak.upgrade() {
            // The time first, then the step's start: a start read after `now` belongs to a step
            // still running at `now`, so a thread descheduled between the two reads cannot
            // count a step that ended meanwhile as an overrun.
            let now_ms = epoch.elapsed().as_millis() as u64 + 1;
            let started = f.step_started_ms.load(Ordering::SeqCst);
            if started > 0 && Duration::from_millis(now_ms.saturating_sub(started)) > limit {
                match &overrun {
                    Overrun::Kill(kill) => {
                        if let Some(pid) = kill() {
                            tracing::error!(target: "gantry::alert", model = %model, limit_s = limit.as_secs_f64(), pid, "engine step overran the watchdog; killed its worker");
                            return;
                        }
                    }
                    Overrun::MarkHung => {
                        if !hung.swap(true, Ordering::SeqCst) {
                            metrics.engine_hung.set(1);
                            tracing::error!(target: "gantry::alert", model = %model, limit_s = limit.as_secs_f64(), "engine step overran the watchdog; marking the engine hung");
                        }
                    }
                }
            }
            drop(f);
            std::thread::sleep(tick);
        }
    })?;
    Ok(())
}
