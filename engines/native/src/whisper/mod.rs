//! Native engine, a speech recognition model as the ABI sees it (engine layer, below the engine
//! host): Whisper (`WhisperForConditionalGeneration`). `seq_set_input` (ABI 1.9) turns a
//! sequence's audio into log-mel features (`mel.rs`) and runs the encoder once
//! (`net.rs`), keeping each decoder layer's cross-attention keys and values with the sequence;
//! `step` then runs the decoder over every entry of the batch at once (all sequences' rows in
//! one product per layer) and samples as the decoders of this engine do. The host feeds the
//! decoder prompt (`<|startoftranscript|>`, language, task) and reads the text, timestamps
//! included, from the tokens. CPU backend only.

mod align;
pub mod mel;
mod net;
mod passes;
mod rules;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use gantry_engine_abi::ffi::GANTRY_MODALITY_TRANSCRIPTION;
use gantry_engine_abi::sdk::{HostLog, Model};
use gantry_engine_abi::{
    EngineConfig, EngineError, Input, LogLevel, ModelDescriptor, ModelInfo, SampledToken, Status,
    StepEntry,
};

use crate::sampler::SeqSampler;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;
use mel::{LogMel, SAMPLE_RATE, WINDOW_SAMPLES};
use net::{Encoded, Net, Row, SelfKv, WhisperConfig};
use rules::Rules;

pub const CLASS: &str = "WhisperForConditionalGeneration";

struct WSeq {
    encoded: Option<Arc<Encoded>>,
    /// Encoder positions holding audio, when the input asked for token times
    /// (`GANTRY_INPUT_ALIGN`).
    align: Option<usize>,
    cache: SelfKv,
    /// Every token the decoder has taken, for the decoding rules.
    tokens: Vec<i32>,
    sampler: Option<SeqSampler>,
}

struct Exec {
    seqs: HashMap<u64, WSeq>,
    next_id: u64,
}

pub struct WhisperModel {
    net: Net,
    mel: LogMel,
    tokenizer: Tokenizer,
    rules: Rules,
    info: ModelInfo,
    exec: Mutex<Exec>,
    pool: rayon::ThreadPool,
    /// The checkpoint's alignment heads, `(decoder layer, head)` (generation_config.json's
    /// `alignment_heads`); empty when it names none, and then no word times.
    alignment_heads: Vec<(usize, usize)>,
    /// `<|startoftranscript|>`, where the prompt the alignment pass repeats starts.
    sot: Option<i32>,
}

impl WhisperModel {
    pub fn load(
        cfg: &EngineConfig,
        desc: &ModelDescriptor,
        dir: &Path,
        config: &[u8],
        log: HostLog,
    ) -> Result<Self, EngineError> {
        if cfg.backend == gantry_engine_abi::Backend::Cuda {
            return Err(EngineError::unsupported(format!(
                "{CLASS}: the CUDA backend of the native engine does not run speech recognition yet (its CPU backend does)"
            )));
        }
        let json: serde_json::Value = serde_json::from_slice(config).map_err(|e| {
            EngineError::new(
                Status::ModelCorrupt,
                format!("config.json is not valid JSON: {e}"),
            )
        })?;
        let wc = WhisperConfig::parse(&json)?;
        let tokenizer = Tokenizer::load(dir, None)?;
        tokenizer.check_vocab(wc.vocab)?;
        let generation = crate::encoder::read_json(&dir.join("generation_config.json"))?;
        let languages = tokenizer
            .specials()
            .filter(|(_, text)| Rules::is_language_token(text))
            .map(|(id, _)| id as usize)
            .collect();
        let rules = Rules::parse(
            &json,
            generation.as_ref(),
            (wc.vocab, wc.eos),
            tokenizer.id("<|notimestamps|>"),
            languages,
        );
        let alignment_heads = passes::alignment_heads(generation.as_ref(), &wc)?;
        let tokenizer_sot = tokenizer.id("<|startoftranscript|>");
        let weights = Arc::new(Weights::open(dir, &desc.primary_file)?);
        let net = Net::load(wc.clone(), weights)?;
        let max_seqs = match desc.max_sequences {
            0 => cfg.max_batch_size,
            n => n,
        }
        .max(1);
        // Per sequence: the cross keys and values of every layer over 1,500 positions, and
        // self keys and values up to the decoder's positions, f32.
        let per_seq =
            ((2 * net::SOURCE_POSITIONS + 2 * wc.max_target) * wc.d_model * wc.decoder_layers * 4)
                as u64;
        let threads = match desc.threads_in(cfg) {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n as usize,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("native-whisper-{i}"))
            .build()
            .map_err(|e| EngineError::internal(format!("thread pool: {e}")))?;
        let info = ModelInfo {
            architecture: CLASS.to_string(),
            vocab_size: wc.vocab as u32,
            context_length: wc.max_target as u32,
            trained_context_length: wc.max_target as u32,
            kv_capacity_tokens: (wc.max_target as u64) * u64::from(max_seqs),
            max_sequences: max_seqs,
            bos_token: None,
            eos_token: Some(wc.eos),
            eog_tokens: vec![wc.eos],
            bytes_used: net.bytes_used() + per_seq * u64::from(max_seqs),
            modalities: GANTRY_MODALITY_TRANSCRIPTION,
            audio_sample_rate: SAMPLE_RATE,
            audio_max_samples: WINDOW_SAMPLES as u64,
            ..ModelInfo::default()
        };
        log.log(
            LogLevel::Info,
            &format!(
                "{}: {CLASS}, {} wide, {}+{} layers, {} mel bins, {} sequences, {threads} threads",
                desc.model_id,
                wc.d_model,
                wc.encoder_layers,
                wc.decoder_layers,
                wc.n_mels,
                max_seqs
            ),
        );
        Ok(Self {
            mel: LogMel::new(wc.n_mels),
            net,
            tokenizer,
            rules,
            info,
            exec: Mutex::new(Exec {
                seqs: HashMap::new(),
                next_id: 1,
            }),
            pool,
            alignment_heads,
            sot: tokenizer_sot,
        })
    }

    fn exec(&self) -> std::sync::MutexGuard<'_, Exec> {
        self.exec.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check(&self, ex: &Exec, entries: &[StepEntry<'_>]) -> Result<(), EngineError> {
        let ctx = self.info.context_length as usize;
        for (i, e) in entries.iter().enumerate() {
            if entries[..i].iter().any(|o| o.seq == e.seq) {
                return Err(EngineError::internal(format!(
                    "sequence {} appears twice in a step",
                    e.seq
                )));
            }
            let s = ex.seqs.get(&e.seq).ok_or_else(|| {
                EngineError::internal(format!("step on unknown sequence {}", e.seq))
            })?;
            if s.encoded.is_none() {
                return Err(EngineError::unsupported(format!(
                    "sequence {}: a speech recognition model decodes only after its audio (seq_set_input)",
                    e.seq
                )));
            }
            if e.tokens.is_empty() {
                return Err(EngineError::internal(format!(
                    "sequence {}: an entry without tokens",
                    e.seq
                )));
            }
            if let Some(t) = e
                .tokens
                .iter()
                .find(|t| !(0..self.info.vocab_size as i32).contains(t))
            {
                return Err(EngineError::unsupported(format!(
                    "sequence {}: token {t} is outside the vocabulary of {}",
                    e.seq, self.info.vocab_size
                )));
            }
            if s.cache.len + e.tokens.len() > ctx {
                return Err(EngineError::unsupported(format!(
                    "sequence {} would hold {} tokens, Whisper's decoder takes {ctx}",
                    e.seq,
                    s.cache.len + e.tokens.len()
                )));
            }
        }
        Ok(())
    }
}

impl WhisperModel {
    /// The decoder over the batch's `rows` (each state's keys and values appended), then a
    /// sample from each wanted row with its sequence's sampler.
    fn decode_and_sample(
        &self,
        states: &mut [(u64, WSeq)],
        entries: &[StepEntry<'_>],
        rows: &[Row],
        want: &[usize],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let encoded: Vec<Arc<Encoded>> = states
            .iter()
            .map(|(_, s)| s.encoded.clone().expect("checked"))
            .collect();
        let encoded: Vec<&Encoded> = encoded.iter().map(|e| &**e).collect();
        let (mut logits, _) = {
            let mut caches: Vec<&mut SelfKv> =
                states.iter_mut().map(|(_, s)| &mut s.cache).collect();
            self.pool.install(|| {
                self.net
                    .decode(rows, &mut caches, &encoded, want, (&[], &[]))
            })
        };
        for ((_, s), e) in states.iter_mut().zip(entries) {
            s.cache.len += e.tokens.len();
            s.tokens.extend_from_slice(e.tokens);
        }
        // Each sampled row in place: nothing reads the logits afterwards.
        let mut rows_out = logits.chunks_exact_mut(self.info.vocab_size as usize);
        let mut out = Vec::with_capacity(want.len());
        for ((_, s), e) in states.iter_mut().zip(entries) {
            let Some(params) = e.sample else {
                out.push(None);
                continue;
            };
            let sampler = s.sampler.get_or_insert_with(|| SeqSampler::new(params));
            let slots = e.result_slots();
            for k in 0..slots {
                let l = rows_out
                    .next()
                    .ok_or_else(|| EngineError::internal("too few logits rows"))?;
                // The decoding rules shape the token that comes next, after the entry's last
                // one; rows within the entry (a prompt scored token by token) stay the
                // model's own distribution, as transformers' forward pass gives it.
                if k + 1 == slots {
                    self.rules.apply(&s.tokens, l);
                }
                out.push(Some(sampler.sample(l, params, e.allowed)?));
            }
        }
        Ok(out)
    }
}

impl Model for WhisperModel {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn tokenize(
        &self,
        text: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        self.tokenizer
            .encode_bytes(text, add_special, parse_special)
    }

    /// Text of the tokens; timestamps (ids past `<|notimestamps|>`, which the released
    /// tokenizers do not list) are special: `<|1.24|>` when rendered, nothing otherwise.
    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        let vocab = self.info.vocab_size as i32;
        let mut out = Vec::new();
        for run in tokens.chunk_by(|a, b| {
            self.rules.timestamp(*a).is_none() && self.rules.timestamp(*b).is_none()
        }) {
            match self.rules.timestamp(run[0]) {
                Some(_) if run[0] >= vocab => {
                    return Err(EngineError::unsupported(format!(
                        "token id {} is outside the vocabulary",
                        run[0]
                    )));
                }
                Some(t) if render_special => out.extend(format!("<|{t:.2}|>").bytes()),
                Some(_) => {}
                None => out.extend(self.tokenizer.bytes_of(run, render_special)?),
            }
        }
        Ok(out)
    }

    fn seq_open(&self) -> Result<u64, EngineError> {
        let mut ex = self.exec();
        crate::check_free_slot(ex.seqs.len(), self.info.max_sequences, None)?;
        let id = ex.next_id;
        ex.next_id += 1;
        let layers = self.net.cfg.decoder_layers;
        ex.seqs.insert(
            id,
            WSeq {
                encoded: None,
                align: None,
                cache: SelfKv::empty(layers),
                tokens: Vec::new(),
                sampler: None,
            },
        );
        Ok(id)
    }

    fn seq_release(&self, seq: u64) {
        self.exec().seqs.remove(&seq);
    }

    fn seq_set_input(&self, seq: u64, input: &Input<'_>) -> Result<(), EngineError> {
        let Input::Audio {
            samples,
            sample_rate,
            align,
        } = *input
        else {
            return Err(EngineError::unsupported(format!(
                "{CLASS} takes audio, not an {} input",
                input.kind()
            )));
        };
        if sample_rate != SAMPLE_RATE {
            return Err(EngineError::unsupported(format!(
                "audio at {sample_rate} Hz: {CLASS} takes {SAMPLE_RATE} Hz (audio_sample_rate)"
            )));
        }
        if samples.is_empty() || samples.len() > WINDOW_SAMPLES {
            return Err(EngineError::unsupported(format!(
                "audio of {} samples: {CLASS} takes 1 to {WINDOW_SAMPLES} (30 s at {SAMPLE_RATE} Hz) at a time",
                samples.len()
            )));
        }
        if !self.exec().seqs.contains_key(&seq) {
            return Err(EngineError::internal(format!(
                "seq_set_input on unknown sequence {seq}"
            )));
        }
        if align && self.alignment_heads.is_empty() {
            return Err(EngineError::unsupported(format!(
                "{CLASS}: word times need the checkpoint's alignment heads, and its generation_config.json names none (`alignment_heads`)"
            )));
        }
        // The encoder runs outside the lock: `step` is never concurrent with this call (the
        // host's scheduler owns both), and `info`/`tokenize` do not take the lock.
        let encoded = self
            .pool
            .install(|| self.net.encode(&self.mel.features(samples)));
        let mut ex = self.exec();
        let s = ex.seqs.get_mut(&seq).ok_or_else(|| {
            EngineError::internal(format!("sequence {seq} was released during its input"))
        })?;
        s.encoded = Some(Arc::new(encoded));
        s.align = align.then(|| align::positions(samples.len()));
        Ok(())
    }

    fn seq_token_times(&self, seq: u64, first: usize) -> Result<Vec<f32>, EngineError> {
        self.times_of(seq, first)
    }

    fn seq_token_prob(&self, seq: u64, n_fed: usize, token: i32) -> Result<f32, EngineError> {
        self.prob_of(seq, n_fed, token)
    }

    fn step(&self, entries: &[StepEntry<'_>]) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let mut guard = self.exec();
        let ex = &mut *guard;
        self.check(ex, entries)?;
        // The batch's rows, each entry's in position order; the rows whose logits are wanted.
        let mut rows = Vec::new();
        let mut want = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let start = ex.seqs[&e.seq].cache.len;
            for (j, &token) in e.tokens.iter().enumerate() {
                let last = j + 1 == e.tokens.len();
                if e.sample.is_some() && (last || e.verifies()) {
                    want.push(rows.len());
                }
                rows.push(Row {
                    seq: i,
                    pos: start + j,
                    token,
                });
            }
        }
        // One state per entry, in entry order (`check` refused a sequence named twice), taken
        // out of the map for the step and put back whatever it ends with.
        let mut states: Vec<(u64, WSeq)> = entries
            .iter()
            .map(|e| ex.seqs.remove_entry(&e.seq).expect("checked"))
            .collect();
        let result = self.decode_and_sample(&mut states, entries, &rows, &want);
        ex.seqs.extend(states);
        result
    }

    fn embed(&self, _tokens: &[i32]) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::unsupported(format!(
            "{CLASS} is a speech recognition model; it embeds nothing"
        )))
    }

    fn seq_cached_tokens(&self, seq: u64) -> Option<u64> {
        // Nothing is reused from a cache: every sequence evaluates its own prompt.
        self.exec().seqs.contains_key(&seq).then_some(0)
    }

    fn seq_fork(&self, src: u64) -> Result<u64, EngineError> {
        let mut ex = self.exec();
        crate::check_free_slot(ex.seqs.len(), self.info.max_sequences, Some(src))?;
        let s = ex
            .seqs
            .get(&src)
            .ok_or_else(|| EngineError::internal(format!("fork of unknown sequence {src}")))?;
        let copy = WSeq {
            encoded: s.encoded.clone(),
            align: s.align,
            cache: s.cache.clone(),
            tokens: s.tokens.clone(),
            sampler: None,
        };
        let id = ex.next_id;
        ex.next_id += 1;
        ex.seqs.insert(id, copy);
        Ok(id)
    }

    fn seq_truncate(&self, seq: u64, n_keep: usize) -> Result<(), EngineError> {
        let d = self.net.cfg.d_model;
        let mut ex = self.exec();
        let s = ex
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| EngineError::internal(format!("truncate of unknown sequence {seq}")))?;
        let dropped = s.cache.len.saturating_sub(n_keep);
        s.cache.truncate(n_keep, d);
        s.tokens.truncate(s.cache.len);

        if let Some(sampler) = s.sampler.as_mut() {
            sampler.forget(dropped);
        }
        Ok(())
    }
}
