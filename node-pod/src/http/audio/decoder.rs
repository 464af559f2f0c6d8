//! Node, speech recognition, between the route (`audio.rs`) and the scheduler: one request's
//! audio decoded window after window, each window a scheduler job (or several: the
//! temperature fallback's samples, `transcript/fallback.rs`), its tokens collected from the
//! job's events and read into segments.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::super::InflightGuard;
use crate::error::ApiError;
use crate::scheduler::{FinishReason, GenEvent, GenerateJob, Job};
use crate::transcript::fallback::{self, Attempt};
use crate::transcript::{self, Segment, Token, TokenLogprob};
use gantry_engine_abi::Sampling;
use gantry_openai::reply::{deadline_exceeded, queue_timeout};

/// One request's decoding: its audio, window after window, each a scheduler job (requests'
/// windows batch together in the scheduler; one request's follow one another, since where a
/// window starts depends on what the one before it said).
pub(super) struct Decoder {
    pub ready: Arc<crate::node::ReadyModel>,
    pub prompt: Vec<i32>,
    pub max_tokens: u32,
    pub first_timestamp: Option<i32>,
    pub sampling: Sampling,
    /// Word times asked for: each window's tokens are aligned with its audio.
    pub align: bool,
    /// The no-speech probability asked for (`verbose_json`): after how many prompt tokens,
    /// and the token.
    pub probe: Option<(usize, i32)>,
    pub timeout: Option<std::time::Duration>,
    pub samples: Vec<f32>,
    pub seconds: f64,
    pub window: usize,
    pub rate: u32,
    /// Temperature fallback and silence skip (`transcript/fallback.rs`): the request's
    /// temperature is 0.
    pub fallback: bool,
    /// The text streams token by token (`stream` with audio of one window): what has left
    /// cannot be taken back, so the window is not decoded again or skipped.
    pub live: bool,
    /// `gantry_transcription_windows_total`, and the model's id for its label.
    pub windows: prometheus::IntCounterVec,
    pub model: String,
    pub _guard: InflightGuard,
}

impl Decoder {
    /// Every window's segments with its `seek` (mel frames); each token's text (and the text
    /// tokens it completes) handed to `on_text` as it comes when the audio is one window (with
    /// several, a window's last words may be decoded again by the next), else each kept
    /// segment's text and tokens.
    pub async fn run(
        &self,
        mut on_text: impl FnMut(&str, &[TokenLogprob]),
    ) -> Result<Vec<(usize, Segment)>, ApiError> {
        let single = self.samples.len() <= self.window;
        let mut out = Vec::new();
        let mut seek = 0;
        // Where the last segment with words ended (the word pass's pause rule).
        let mut last_speech = 0.0;
        while seek < self.samples.len() {
            let chunk = &self.samples[seek..(seek + self.window).min(self.samples.len())];
            let attempt = self
                .decode_window(chunk, |t, lp| {
                    if self.live {
                        on_text(t, lp)
                    }
                })
                .await
                .map_err(|mut e| {
                    // What the engine refuses of a request for word times is the word times
                    // (a checkpoint without alignment heads, an engine that cannot align).
                    if self.align && e.status == 400 && e.param.is_none() {
                        e.param = Some("timestamp_granularities".into());
                    }
                    e
                })?;
            let silent = self.fallback && !self.live && attempt.is_silence();
            let outcome = match (silent, attempt.temperature > self.sampling.temperature) {
                (true, _) => "silence",
                (false, true) => "fallback",
                (false, false) => "first",
            };
            self.windows
                .with_label_values(&[&self.model, outcome])
                .inc();
            if silent {
                seek += chunk.len();
                continue;
            }
            let read = transcript::read_window(
                (&attempt.tokens, attempt.tail),
                self.first_timestamp,
                seek as f64 / f64::from(self.rate),
                (chunk.len(), self.rate),
                self.seconds,
                &mut last_speech,
            );
            let frame = (seek as u64 * 100 / u64::from(self.rate.max(1))) as usize;
            for mut s in read.segments {
                s.no_speech_prob = attempt.no_speech;
                s.temperature = attempt.temperature;
                if !single {
                    on_text(&s.text, &s.logprobs);
                }
                out.push((frame, s));
            }
            seek += read.advance.max(1);
        }
        Ok(out)
    }

    /// One window's answer: at the request's temperature, or with the fallback, greedily and
    /// then at each higher temperature (best of [`fallback::BEST_OF`] samples) until an answer
    /// passes. `on_text` sees the first decode's tokens as they come. Each decode (a
    /// temperature's samples together) gets the request's timeout from its start, as each
    /// window does: a long recording, or a window decoded again, is not cut by one deadline.
    async fn decode_window(
        &self,
        chunk: &[f32],
        on_text: impl FnMut(&str, &[TokenLogprob]),
    ) -> Result<Attempt, ApiError> {
        let submit = |draws: &[Sampling], probe| {
            submit(
                &self.ready,
                (&self.prompt, self.max_tokens),
                draws,
                (self.align, probe),
                self.timeout,
                chunk,
            )
        };
        let t0 = self.sampling.temperature;
        let rx = submit(std::slice::from_ref(&self.sampling), self.probe)?.remove(0);
        let first = collect(rx, t0, on_text).await?;
        if !self.fallback || self.live {
            return Ok(first);
        }
        let no_speech = first.no_speech;
        let mut answer = first;
        for &t in &fallback::TEMPERATURES[1..] {
            if !answer.needs_fallback() {
                break;
            }
            // Seeded samples, so that a request's answer is the same every time; one job and
            // its forks, which start from one evaluation of the prompt (and one encoding of the
            // audio) where the engine can fork.
            let draws: Vec<Sampling> = (1..=fallback::BEST_OF as u64)
                .map(|seed| Sampling {
                    temperature: t,
                    seed,
                    ..self.sampling.clone()
                })
                .collect();
            let samples = futures::future::try_join_all(
                submit(&draws, None)?
                    .into_iter()
                    .map(|rx| collect(rx, t, |_, _| {})),
            )
            .await?;
            if let Some(mut best) = fallback::best(samples) {
                // The no-speech probability is the first step's, the same at every
                // temperature: asked for once.
                best.no_speech = no_speech;
                answer = best;
            }
        }
        Ok(answer)
    }
}

/// One window as a scheduler job per draw: `prompt` and at most `max_tokens` sampled after it,
/// the window's audio given to the engine when its sequence opens. The first draw is the job
/// (with the probe, when asked for), the others its forks (`n` > 1's way: they start from the
/// evaluated prompt where the engine can fork). A receiver per draw, in order.
pub(super) fn submit(
    ready: &crate::node::ReadyModel,
    (prompt, max_tokens): (&[i32], u32),
    draws: &[Sampling],
    (align, probe): (bool, Option<(usize, i32)>),
    timeout: Option<std::time::Duration>,
    chunk: &[f32],
) -> Result<Vec<mpsc::UnboundedReceiver<GenEvent>>, ApiError> {
    let deadline = timeout.map(|d| Instant::now() + d);
    let audio = Arc::new(chunk.to_vec());
    let mut receivers = Vec::with_capacity(draws.len());
    let mut jobs: Vec<GenerateJob> = draws
        .iter()
        .enumerate()
        .map(|(i, sampling)| {
            let (tx, rx) = mpsc::unbounded_channel();
            receivers.push(rx);
            GenerateJob {
                prompt: prompt.to_vec(),
                max_tokens,
                sampling: sampling.clone(),
                stop: Vec::new(),
                logprobs: Some(0),
                deadline,
                fresh: true,
                grammar: None,
                arrived: Instant::now(),
                events: tx,
                retried: false,
                forks: Vec::new(),
                speculate: false,
                adapter: None,
                audio: Some(Arc::clone(&audio)),
                align,
                probe: probe.filter(|_| i == 0),
            }
        })
        .collect();
    if jobs.is_empty() {
        return Err(ApiError::internal("a window decoded with no draw"));
    }
    let mut job = jobs.remove(0);
    job.forks = jobs;
    ready.scheduler.submit(Job::Generate(job))?;
    Ok(receivers)
}

/// A window's tokens, each token's text handed to `on_text` as it comes with the text tokens
/// since the last text (a token that ends inside a UTF-8 character gives its text with the
/// next); with word times, each token's time and the time after the last token; the
/// probability the job asked for; the end of text's log-probability. `temperature` is the one
/// the job sampled at.
pub(super) async fn collect(
    mut rx: mpsc::UnboundedReceiver<GenEvent>,
    temperature: f32,
    mut on_text: impl FnMut(&str, &[TokenLogprob]),
) -> Result<Attempt, ApiError> {
    let mut tail = None;
    let mut probe = None;
    let mut stop = None;
    let mut tokens = Vec::new();
    let mut unsent = 0;
    loop {
        match rx.recv().await {
            Some(GenEvent::Token { text, logprob }) => {
                if let Some(lp) = logprob {
                    tokens.push(Token {
                        id: lp.token,
                        bytes: lp.bytes,
                        logprob: lp.logprob,
                        time: None,
                    });
                }
                if !text.is_empty() {
                    on_text(&text, &TokenLogprob::of(&tokens[unsent..]));
                    unsent = tokens.len();
                }
            }
            // One time per sampled token: the visible ones, then the end of text's (where the
            // text ends).
            Some(GenEvent::Times(times)) => {
                for (t, at) in tokens.iter_mut().zip(&times) {
                    t.time = Some(*at);
                }
                tail = times.get(tokens.len()).copied();
            }
            Some(GenEvent::Probe(p)) => probe = Some(p),
            Some(GenEvent::StopLogprob(lp)) => stop = Some(lp),
            Some(GenEvent::Done {
                reason: FinishReason::Deadline,
                completion_tokens,
                ..
            }) => return Err(deadline_exceeded(completion_tokens)),
            Some(GenEvent::Done {
                reason: FinishReason::QueueTimeout,
                queued,
                ..
            }) => return Err(queue_timeout(queued)),
            Some(GenEvent::Done { .. }) => {
                return Ok(Attempt {
                    tokens,
                    tail,
                    no_speech: probe,
                    stop_logprob: stop,
                    temperature,
                });
            }
            Some(GenEvent::Error(e)) => return Err(ApiError::from(e)),
            None => {
                return Err(ApiError::internal(
                    "the scheduler ended the transcription without an answer",
                ));
            }
        }
    }
}
