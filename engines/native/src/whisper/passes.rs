//! Whisper's decoder passes outside the batch (engine side of ABI 1.11, after a sequence's
//! last step and before its release): a pass of its own over a sequence's tokens from position
//! 0, for the tokens' times (`seq_token_times`, timed by `align.rs`) and for one token's
//! probability under the raw logits (`seq_token_prob`, Whisper's no-speech probability); and
//! the checkpoint's alignment heads, read at load.

use gantry_engine_abi::{EngineError, Status};

use super::net::{Encoded, Row, SelfKv, WhisperConfig};
use super::{CLASS, WhisperModel, align};

impl WhisperModel {
    /// A decoder pass of its own over `tokens` from position 0 with `encoded` (a cache that
    /// lives for the pass only): the logits of the rows `want` names, and with `align` the
    /// alignment heads' scores of every row.
    fn pass_alone(
        &self,
        encoded: &Encoded,
        tokens: &[i32],
        want: &[usize],
        align: bool,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let rows: Vec<Row> = tokens
            .iter()
            .enumerate()
            .map(|(pos, &token)| Row { seq: 0, pos, token })
            .collect();
        let mut cache = SelfKv::empty(self.net.cfg.decoder_layers);
        let heads: &[(usize, usize)] = if align { &self.alignment_heads } else { &[] };
        self.pool.install(|| {
            self.net.decode(
                &rows,
                &mut [&mut cache],
                &[encoded],
                want,
                (heads, &[align]),
            )
        })
    }

    /// One time per token fed from `first` on (`fed`: every token the sequence took), as
    /// openai-whisper's `find_alignment` times a window's text: a decoder pass of its own over
    /// the start of the prompt (from its `<|startoftranscript|>`), `<|notimestamps|>` and the
    /// text tokens the sequence decoded (timestamps left out), the alignment heads' attention
    /// kept, and [`align::times`]. The token fed before each decoded text token gets that text
    /// token's time; before a timestamp, the next text token's; the last, where the text ends.
    fn token_times(
        &self,
        encoded: &Encoded,
        positions: usize,
        fed: &[i32],
        first: usize,
    ) -> Result<Vec<f32>, EngineError> {
        if first >= fed.len() || self.alignment_heads.is_empty() {
            return Ok(Vec::new());
        }
        let no_ts = self.rules.no_timestamps().ok_or_else(|| {
            EngineError::unsupported(format!("{CLASS}: word times need <|notimestamps|>"))
        })?;
        let eot = self.info.eos_token.unwrap_or(i32::MAX);
        let prompt = &fed[..=first];
        let start = self
            .sot
            .and_then(|sot| prompt.iter().rposition(|&t| t == sot))
            .unwrap_or(0);
        let mut tokens: Vec<i32> = prompt[start..]
            .iter()
            .copied()
            .filter(|&t| t != no_ts)
            .collect();
        let lead = tokens.len();
        tokens.push(no_ts);
        // What the sequence decoded: the tokens fed after the prompt (its last sampled token,
        // never fed, is the end of text or the token limit's last).
        let decoded = &fed[first + 1..];
        let is_text = |t: i32| t < eot && self.rules.timestamp(t).is_none();
        tokens.extend(decoded.iter().copied().filter(|&t| is_text(t)));
        // The end of text closes it, as in openai-whisper's pass: its row counts in the
        // normalisation, not in the warping.
        if let Some(e) = self.info.eos_token {
            tokens.push(e);
        }
        if tokens.len() > self.info.context_length as usize {
            return Err(EngineError::unsupported(format!(
                "{CLASS}: {} tokens to align, the decoder takes {}",
                tokens.len(),
                self.info.context_length
            )));
        }
        let (_, kept) = self.pass_alone(encoded, &tokens, &[], true);
        // Rows from `<|notimestamps|>` to the last text token: row k is the token before text
        // token k.
        let end_row = kept.len() - usize::from(self.info.eos_token.is_some());
        let jumps = align::times(&kept, lead..end_row, positions, self.alignment_heads.len());
        let end = jumps.last().copied().unwrap_or(0.0);
        let mut out = Vec::with_capacity(fed.len() - first);
        let mut k = 0;
        for &t in decoded {
            out.push(jumps.get(k).copied().unwrap_or(end));
            if is_text(t) {
                k += 1;
            }
        }
        // The token before the last sampled one (not fed): where the text ends.
        out.push(jumps.get(k).copied().unwrap_or(end));
        Ok(out)
    }

    /// `seq_token_times`: the sequence's state read under the lock, the pass outside it.
    pub(super) fn times_of(&self, seq: u64, first: usize) -> Result<Vec<f32>, EngineError> {
        let ex = self.exec();
        let s = ex.seqs.get(&seq).ok_or_else(|| {
            EngineError::internal(format!("seq_token_times on unknown sequence {seq}"))
        })?;
        let positions = s.align.ok_or_else(|| {
            EngineError::unsupported(format!(
                "sequence {seq}: its input did not ask for token times (GANTRY_INPUT_ALIGN)"
            ))
        })?;
        let encoded = s.encoded.clone().ok_or_else(|| {
            EngineError::internal(format!("sequence {seq} has no audio to align with"))
        })?;
        let fed = s.tokens.clone();
        drop(ex);
        self.token_times(&encoded, positions, &fed, first)
    }

    /// `seq_token_prob`: the raw softmax at `token` after the sequence's first `n_fed` tokens.
    pub(super) fn prob_of(&self, seq: u64, n_fed: usize, token: i32) -> Result<f32, EngineError> {
        let ex = self.exec();
        let s = ex.seqs.get(&seq).ok_or_else(|| {
            EngineError::internal(format!("seq_token_prob on unknown sequence {seq}"))
        })?;
        if n_fed == 0 || n_fed > s.tokens.len() {
            return Err(EngineError::unsupported(format!(
                "sequence {seq}: {n_fed} tokens asked for, {} fed",
                s.tokens.len()
            )));
        }
        if !(0..self.info.vocab_size as i32).contains(&token) {
            return Err(EngineError::unsupported(format!(
                "token {token} is outside the vocabulary of {}",
                self.info.vocab_size
            )));
        }
        let encoded = s
            .encoded
            .clone()
            .ok_or_else(|| EngineError::internal(format!("sequence {seq} has no audio")))?;
        let fed = s.tokens[..n_fed].to_vec();
        drop(ex);
        // A decoder pass of its own over those tokens, the last row's raw logits.
        let (logits, _) = self.pass_alone(&encoded, &fed, &[n_fed - 1], false);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = logits.iter().map(|l| (l - max).exp()).sum();
        Ok((logits[token as usize] - max).exp() / sum)
    }
}

/// The alignment heads generation_config.json names (`alignment_heads`: `[layer, head]`
/// pairs), each within the decoder; none when it names none.
pub(super) fn alignment_heads(
    generation: Option<&serde_json::Value>,
    wc: &WhisperConfig,
) -> Result<Vec<(usize, usize)>, EngineError> {
    let Some(list) = generation.and_then(|g| g.get("alignment_heads")) else {
        return Ok(Vec::new());
    };
    let bad = || {
        EngineError::new(
            Status::ModelCorrupt,
            format!(
                "generation_config.json: `alignment_heads` must be [layer, head] pairs within {} layers of {} heads, got {list}",
                wc.decoder_layers, wc.heads
            ),
        )
    };
    list.as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|p| {
            let pair = p.as_array().filter(|a| a.len() == 2).ok_or_else(bad)?;
            let at = |k: usize| pair[k].as_u64().map(|v| v as usize).ok_or_else(bad);
            let (layer, head) = (at(0)?, at(1)?);
            if layer >= wc.decoder_layers || head >= wc.heads {
                return Err(bad());
            }
            Ok((layer, head))
        })
        .collect()
}
