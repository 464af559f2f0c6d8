//! Node state, engine worker crashes (beside the lifecycle; entered from a worker's reaper
//! thread, and from a scheduler whose worker died under a request): take the model out of
//! service, restart it with exponential backoff, and send the requests that had not
//! received a token yet to the restarted model.
//!
//! Only models of plugins in `process` isolation have workers (gantry-engine-host's worker.rs); an
//! in-process plugin's crash is the node's crash, which Kubernetes restarts.
//!
//! The backoff counts crashes in a row: the first restarts at once, the next after 1 s, then
//! 2, 4, ... up to 60 s; a crash after a quiet minute starts again from the first. While a
//! restart waits, the model answers 503 `engine_restarting` with `Retry-After`.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use gantry_api::CrashStatus;

use super::{ModelState, Node, ServedModel};
use crate::memory::Note;
use crate::scheduler::{GenError, GenEvent, GenerateJob};
use gantry_api::WorkerCrash;

/// A crash this long after the previous one starts the backoff again.
pub const QUIET: Duration = Duration::from_secs(60);
/// The longest wait before a restart.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How long an interrupted request waits for its model to come back before it fails.
pub const RETRY_WAIT: Duration = Duration::from_secs(30);

/// A model's crashes.
#[derive(Debug, Default)]
pub struct CrashRecord {
    pub count: u64,
    pub consecutive: u64,
    pub last: Option<(WorkerCrash, Instant)>,
    /// When the pending restart runs.
    pub restart_at: Option<Instant>,
}

impl CrashRecord {
    /// Count a crash at `now`; the wait before the restart it causes.
    fn count(&mut self, crash: WorkerCrash, now: Instant) -> Duration {
        self.count += 1;
        self.consecutive = match &self.last {
            Some((_, at)) if now.duration_since(*at) < QUIET => self.consecutive + 1,
            _ => 1,
        };
        self.last = Some((crash, now));
        backoff(self.consecutive)
    }

    /// `/v1/status`'s view; `None` when it never crashed.
    pub fn status(&self, now: Instant) -> Option<CrashStatus> {
        let (c, at) = self.last.as_ref()?;
        Some(CrashStatus {
            count: self.count,
            consecutive: self.consecutive,
            plugin: c.plugin.clone(),
            reason: c.reason().into(),
            signal: c.signal.clone(),
            exit_code: c.exit_code,
            message: c.message(),
            seconds_ago: now.duration_since(*at).as_secs(),
            restart_in_seconds: self.restart_at.map_or(0, |r| {
                r.saturating_duration_since(now).as_secs_f64().ceil() as u64
            }),
        })
    }

    /// The restart a request must wait for: how long, and why.
    pub fn waiting_restart(&self, now: Instant) -> Option<(Duration, String)> {
        let at = self.restart_at.filter(|r| *r > now)?;
        let why = self
            .last
            .as_ref()
            .map(|(c, _)| c.message())
            .unwrap_or_default();
        Some((at - now, why))
    }
}

/// The wait before restarting after `consecutive` crashes in a row.
pub fn backoff(consecutive: u64) -> Duration {
    match consecutive {
        0 | 1 => Duration::ZERO,
        n => Duration::from_secs(1u64 << (n - 2).min(6)).min(MAX_BACKOFF),
    }
}

/// Whether `pid` is one of the workers serving `m` now.
fn serves(m: &ServedModel, pid: u32) -> bool {
    m.ready().is_some_and(|r| {
        r.scheduler
            .iter()
            .any(|rep| rep.shared.worker_pid() == Some(pid))
    })
}

impl Node {
    /// Route worker crashes to this node (once, at start).
    pub(crate) fn watch_workers(self: &Arc<Self>) {
        let _ = self.me.set(Arc::downgrade(self));
        let node: Weak<Node> = Arc::downgrade(self);
        let _ = self.workers.hook.set(Arc::new(move |crash: WorkerCrash| {
            if let Some(n) = node.upgrade() {
                n.on_worker_crash(crash);
            }
        }));
    }

    /// A worker ended on its own: count it, take its model out of service and restart it.
    pub(crate) fn on_worker_crash(self: &Arc<Self>, crash: WorkerCrash) {
        self.metrics
            .engine_crashes
            .with_label_values(&[&crash.model, &crash.plugin, crash.reason()])
            .inc();
        let Some(m) = self.model(&crash.model) else {
            return;
        };
        let now = Instant::now();
        let current = serves(&m, crash.pid);
        let delay = {
            let mut rec = m.crashes.lock().unwrap_or_else(|p| p.into_inner());
            let delay = rec.count(crash.clone(), now);
            if current {
                rec.restart_at = Some(now + delay);
            }
            delay
        };
        if !current {
            // A worker of an instance that was already replaced (or one that died while
            // loading, which the load reports itself).
            return;
        }
        {
            let _serial = m.load_lock.lock().unwrap_or_else(|p| p.into_inner());
            if serves(&m, crash.pid) {
                // Dropping the ready model stops its schedulers and the other replicas'
                // workers; the model is reloaded whole.
                m.set(ModelState::Idle);
                m.memory.set_note(Some(Note::Unloaded(format!(
                    "{}; restarting in {} s",
                    crash.message(),
                    delay.as_secs()
                ))));
            }
        }
        let node = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("restart-{}", crash.model))
            .spawn(move || {
                std::thread::sleep(delay);
                m.crashes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .restart_at = None;
                if m.is_retired() || !matches!(m.state(), ModelState::Idle) {
                    return; // a request loaded it already, or a reload removed it
                }
                tracing::info!(model = %m.config.id, "restarting the model after its engine worker crashed");
                node.load(&m);
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the restart thread");
        }
    }

    /// Send `jobs` (interrupted by `crash` before their first token) to the model once it is
    /// back; those it cannot place within [`RETRY_WAIT`] end with the crash error.
    pub(crate) fn requeue(self: &Arc<Self>, jobs: Vec<GenerateJob>, crash: WorkerCrash) {
        let node = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("requeue-{}", crash.model))
            .spawn(move || {
                let deadline = Instant::now() + RETRY_WAIT;
                let mut jobs = jobs;
                while Instant::now() < deadline && !jobs.is_empty() {
                    jobs.retain(|j| !j.events.is_closed());
                    let m = node.model(&crash.model).filter(|m| !m.is_retired());
                    let Some(m) = m else { break };
                    if let Some(r) = m.ready().filter(|_| !serves(&m, crash.pid)) {
                        for job in jobs.drain(..) {
                            node.metrics
                                .crash_retries
                                .with_label_values(&[&crash.model, "retried"])
                                .inc();
                            if let Err(j) = r.scheduler.submit_or_return(job) {
                                let _ = j
                                    .events
                                    .send(GenEvent::Error(GenError::Crashed(crash.clone())));
                            }
                        }
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                for job in jobs {
                    node.metrics
                        .crash_retries
                        .with_label_values(&[&crash.model, "failed"])
                        .inc();
                    let _ = job
                        .events
                        .send(GenEvent::Error(GenError::Crashed(crash.clone())));
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the requeue thread");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crash(pid: u32) -> WorkerCrash {
        WorkerCrash {
            plugin: "faulty".into(),
            model: "m".into(),
            pid,
            signal: Some("SIGSEGV".into()),
            exit_code: None,
            hung: false,
        }
    }

    #[test]
    fn the_backoff_doubles_up_to_a_minute_and_starts_over_after_a_quiet_minute() {
        let waits: Vec<u64> = (1..=10).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(waits, [0, 1, 2, 4, 8, 16, 32, 60, 60, 60]);

        let mut rec = CrashRecord::default();
        let t0 = Instant::now();
        assert_eq!(rec.count(crash(1), t0), Duration::ZERO);
        assert_eq!(
            rec.count(crash(2), t0 + Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        assert_eq!(
            rec.count(crash(3), t0 + Duration::from_secs(3)),
            Duration::from_secs(2)
        );
        assert_eq!((rec.count, rec.consecutive), (3, 3));
        // A quiet minute later the next crash restarts at once again.
        assert_eq!(
            rec.count(crash(4), t0 + Duration::from_secs(70)),
            Duration::ZERO
        );
        assert_eq!((rec.count, rec.consecutive), (4, 1));
        let s = rec.status(t0 + Duration::from_secs(75)).expect("crashed");
        assert_eq!(s.signal.as_deref(), Some("SIGSEGV"));
        assert_eq!(s.reason, "crashed");
        assert_eq!(s.seconds_ago, 5);
        assert!(
            s.message.contains("pid 4") && s.message.contains("SIGSEGV"),
            "{}",
            s.message
        );
    }
}
