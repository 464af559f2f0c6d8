//! Speech synthesis on the scheduler thread (HTTP handler → scheduler → engine, ABI 1.10):
//! a speech job opens a synthesis in the engine, then gets one piece per scheduler turn,
//! between the steps of whatever else the replica runs, so several syntheses take turns and
//! a long text never holds the engine for more than one piece. Each piece goes to the
//! handler as soon as it is made (streamed responses send it on).

use std::time::{Duration, Instant};

use gantry_engine_abi::{EngineError, SpeechRequest, Status};
use tokio::sync::mpsc;

use crate::engine::Engine;
use crate::job::GenError;
use crate::run::Scheduler;

/// One text to speak, validated by the node.
#[derive(Debug)]
pub struct SpeechJob {
    /// Never empty.
    pub text: String,
    /// One of the model's voices; `None`: its default.
    pub voice: Option<String>,
    /// Pace, within [0.25, 4].
    pub speed: f32,
    pub deadline: Option<Instant>,
    pub arrived: Instant,
    pub events: mpsc::UnboundedSender<SpeechEvent>,
}

/// What a speech job's channel carries.
#[derive(Clone, Debug, PartialEq)]
pub enum SpeechEvent {
    /// The next piece: mono samples in [-1, 1] at the model's `audio_sample_rate`.
    Audio(Vec<f32>),
    /// The last piece was sent; with the time spent queued.
    Done { queued: Duration },
    /// The synthesis failed (or its deadline passed); no more events follow.
    Error(GenError),
}

/// A speech job on its way: its engine handle once opened.
pub(crate) struct Speaking {
    job: SpeechJob,
    handle: Option<u64>,
    queued: Duration,
}

impl Speaking {
    pub(crate) fn new(job: SpeechJob) -> Self {
        Speaking {
            job,
            handle: None,
            queued: Duration::ZERO,
        }
    }

    /// Tell the job it failed.
    pub(crate) fn fail(&self, e: GenError) {
        let _ = self.job.events.send(SpeechEvent::Error(e));
    }
}

impl<E: Engine> Scheduler<E> {
    /// One piece of the first speech in line, which then goes to the back; a speech that
    /// ended (done, failed, abandoned, past its deadline) leaves the line and the engine.
    pub(crate) fn speak(&mut self) {
        let Some(mut s) = self.speeches.pop_front() else {
            return;
        };
        let finished = match self.speak_one(&mut s) {
            Ok(done) => done,
            Err(e) => {
                // Counted as a failed generation is (`gantry_request_finish_total{reason="error"}`).
                self.metrics.finished("error");
                let e = self.failure(e);
                s.fail(e);
                true
            }
        };
        if finished {
            if let Some(h) = s.handle {
                self.engine.speech_close(h);
            }
        } else {
            self.speeches.push_back(s);
        }
    }

    /// Whether `s` is finished after this turn.
    fn speak_one(&mut self, s: &mut Speaking) -> Result<bool, EngineError> {
        if s.job.events.is_closed() {
            self.metrics.finished("cancelled");
            return Ok(true);
        }
        if s.job.deadline.is_some_and(|d| d <= Instant::now()) {
            self.metrics.finished("deadline");
            s.fail(GenError::Engine(EngineError::new(
                Status::Timeout,
                "the request deadline passed while its speech was synthesized",
            )));
            return Ok(true);
        }
        let handle = match s.handle {
            Some(h) => h,
            None => {
                s.queued = s.job.arrived.elapsed();
                self.metrics.queue_seconds.observe(s.queued.as_secs_f64());
                let req = SpeechRequest {
                    text: &s.job.text,
                    voice: s.job.voice.as_deref(),
                    speed: s.job.speed,
                };
                let h = self.engine.speech_open(&req)?;
                s.handle = Some(h);
                h
            }
        };
        // The watchdog times a piece as it times a step.
        self.figures.step_began(self.epoch);
        let piece = self.engine.speech_next(handle);
        self.figures.step_ended();
        let piece = piece?;
        if !piece.samples.is_empty() {
            let _ = s.job.events.send(SpeechEvent::Audio(piece.samples));
        }
        if piece.done {
            self.metrics.finished("stop");
            let _ = s.job.events.send(SpeechEvent::Done { queued: s.queued });
        }
        Ok(piece.done)
    }

    /// The engine is gone or unloading: every speech in line fails or is closed.
    pub(crate) fn end_speeches(&mut self, crash: Option<GenError>) {
        for s in std::mem::take(&mut self.speeches) {
            match &crash {
                Some(e) => s.fail(e.clone()),
                None => {
                    if let Some(h) = s.handle {
                        self.engine.speech_close(h);
                    }
                }
            }
        }
    }
}
