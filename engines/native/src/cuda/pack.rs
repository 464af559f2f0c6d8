//! Native engine, CUDA backend, in the step: the host side of the step's one input copy and one
//! output copy.
//!
//! [`pack`] lays a step out as 32-bit words: a header of section offsets (the `IN_*` indices of
//! `kernels/common.cuh`), then the tokens, positions, cache cells, sequence of each token, the
//! block tables, the rows to sample, each row's sampling parameters (`P_*` of
//! `kernels/sample.cu`), the logit adjustments (bias and penalty counts merged per token) and
//! the allowed-token masks. The kernels read every per-step value from there, so one captured
//! graph serves every step of its batch size. [`unpack`] reads the sampler's output words.

use std::collections::BTreeMap;

use gantry_engine_abi::{EngineError, SampledToken};

use super::int;
use crate::backend::{SampleRow, StepInput};

pub(super) const HEADER: usize = 16;
const IN_N_TOKENS: usize = 0;
const IN_TOKENS: usize = 1;
const IN_POSITIONS: usize = 2;
const IN_CELLS: usize = 3;
const IN_SEQ_OF: usize = 4;
const IN_TABLE_OFF: usize = 5;
const IN_TABLES: usize = 6;
const IN_ROWS: usize = 7;
const IN_PARAMS: usize = 8;
const IN_ADJ: usize = 9;
const IN_MASKS: usize = 10;
const IN_MASK_WORDS: usize = 11;
const IN_N_ROWS: usize = 12;

/// Parameter words per sampled row.
pub(super) const P_WORDS: usize = 16;
const F_GREEDY: i32 = 1;
const F_LOGPROB: i32 = 2;
const F_SKIP: i32 = 4;
/// Output words per sampled row: token, logprob, 20 (id, logprob) pairs.
pub(super) const OUT_WORDS: usize = 42;
const MAX_TOP: usize = 20;

/// Where padding slots of a graph's batch point: a block of the cache no sequence owns.
pub(super) struct Padding {
    pub to: usize,
    pub dummy_block: u32,
}

/// What [`pack`] laid out, for the launches and the output read.
pub(super) struct Packed {
    /// Token slots the kernels run over (the step's tokens, or the graph's batch size).
    pub n_tokens: usize,
    /// Logits rows (sampled rows, padding included).
    pub n_rows: usize,
    /// Rows are the tokens in order (a decode step): no gather before the output product.
    pub identity_rows: bool,
    /// Adjustment entries (the sampler's scratch holds one float each).
    pub n_adj: usize,
}

fn f(v: f32) -> i32 {
    v.to_bits() as i32
}

/// Lay the step out in `w` (cleared first). `rows` are the sampled rows in `logits_rows`
/// order (empty when only logits are wanted); `padding` pads a decode step to a graph's size.
pub(super) fn pack(
    w: &mut Vec<i32>,
    input: &StepInput<'_>,
    rows: &[SampleRow<'_>],
    padding: Option<&Padding>,
    block_size: usize,
    vocab: usize,
) -> Result<Packed, EngineError> {
    let t = input.tokens.len();
    let n = padding.map_or(t, |p| p.to);
    let n_rows = if padding.is_some() {
        n
    } else {
        input.logits_rows.len()
    };
    let mask_words = vocab.div_ceil(32);
    w.clear();
    w.resize(HEADER, 0);
    let section = |w: &mut Vec<i32>, at: usize| -> Result<(), EngineError> {
        w[at] = int(w.len())?;
        Ok(())
    };
    w[IN_N_TOKENS] = int(n)?;
    w[IN_N_ROWS] = int(n_rows)?;
    w[IN_MASK_WORDS] = int(mask_words)?;
    let dummy = padding.map(|p| p.dummy_block);

    section(w, IN_TOKENS)?;
    w.extend_from_slice(input.tokens);
    w.resize(w.len() + (n - t), 0);
    section(w, IN_POSITIONS)?;
    for &p in input.positions {
        w.push(int(p)?);
    }
    w.resize(w.len() + (n - t), 0);
    section(w, IN_CELLS)?;
    for (i, &p) in input.positions.iter().enumerate() {
        let table = input.tables[input.seq_of[i]];
        let block = *table.get(p / block_size).ok_or_else(|| {
            EngineError::internal(format!("position {p} is past its sequence's block table"))
        })?;
        w.push(int(block as usize * block_size + p % block_size)?);
    }
    if let Some(d) = dummy {
        let cell = int(d as usize * block_size)?;
        w.resize(w.len() + (n - t), cell);
    }
    section(w, IN_SEQ_OF)?;
    for &s in input.seq_of {
        w.push(int(s)?);
    }
    // Padding slots belong to one more table: the dummy block.
    w.resize(w.len() + (n - t), int(input.tables.len())?);
    section(w, IN_TABLE_OFF)?;
    let mut off = 0usize;
    for table in input.tables {
        w.push(int(off)?);
        off += table.len();
    }
    w.push(int(off)?);
    section(w, IN_TABLES)?;
    for table in input.tables {
        w.extend(table.iter().map(|&b| b as i32));
    }
    w.push(dummy.map_or(0, |d| d as i32));
    section(w, IN_ROWS)?;
    for &r in input.logits_rows {
        w.push(int(r)?);
    }
    for r in input.logits_rows.len()..n_rows {
        w.push(int(r)?);
    }
    let identity_rows =
        input.logits_rows.len() == t && input.logits_rows.iter().enumerate().all(|(i, &r)| i == r);

    // Sampling parameters, then the adjustments and masks they point at.
    section(w, IN_PARAMS)?;
    let params_at = w.len();
    w.resize(params_at + n_rows * P_WORDS, 0);
    let mut adj: Vec<(i32, i32, f32)> = Vec::new();
    let mut masks: Vec<&[u32]> = Vec::new();
    for r in 0..n_rows {
        let p = &mut w[params_at + r * P_WORDS..params_at + (r + 1) * P_WORDS];
        let Some(row) = rows.get(r) else {
            p[0] = F_SKIP;
            p[14] = -1;
            continue;
        };
        let s = row.params;
        p[0] =
            if s.is_greedy() { F_GREEDY } else { 0 } | if s.want_logprob { F_LOGPROB } else { 0 };
        p[1] = f(s.temperature);
        p[2] = s.top_k;
        p[3] = f(s.top_p);
        p[4] = f(s.min_p);
        p[5] = f(s.repetition_penalty);
        p[6] = f(s.frequency_penalty);
        p[7] = f(s.presence_penalty);
        p[8] = s.seed as u32 as i32;
        p[9] = (s.seed >> 32) as u32 as i32;
        p[10] = row.draw as u32 as i32;
        p[11] = (row.draw >> 32) as u32 as i32;
        let start = adj.len();
        adjustments(row, vocab, &mut adj);
        p[12] = int(start)?;
        p[13] = int(adj.len() - start)?;
        p[14] = match row.allowed {
            Some(m) => {
                masks.push(m);
                int(masks.len() - 1)?
            }
            None => -1,
        };
        p[15] = s.top_logprobs.min(MAX_TOP as u32) as i32;
    }
    section(w, IN_ADJ)?;
    for &(tok, count, bias) in &adj {
        w.extend_from_slice(&[tok, count, f(bias)]);
    }
    section(w, IN_MASKS)?;
    for m in masks {
        let at = w.len();
        w.extend(m.iter().take(mask_words).map(|&x| x as i32));
        w.resize(at + mask_words, 0);
    }
    Ok(Packed {
        n_tokens: n,
        n_rows,
        identity_rows,
        n_adj: adj.len(),
    })
}

/// One row's logit adjustments, one entry per token: (token, times generated in the
/// penalties' window, bias). llama.cpp's window: the last `penalty_last_n` generated tokens
/// (-1: all of them, 0: none).
fn adjustments(row: &SampleRow<'_>, vocab: usize, out: &mut Vec<(i32, i32, f32)>) {
    let s = row.params;
    let mut by_token: BTreeMap<i32, (i32, f32)> = BTreeMap::new();
    let in_vocab = |t: i32| usize::try_from(t).is_ok_and(|t| t < vocab);
    for &(t, b) in &s.logit_bias {
        if in_vocab(t) {
            by_token.entry(t).or_default().1 += b;
        }
    }
    if s.has_penalties() {
        let g = row.generated;
        let n = match s.penalty_last_n {
            0 => 0,
            n if n < 0 => g.len(),
            n => (n as usize).min(g.len()),
        };
        for &t in &g[g.len() - n..] {
            if in_vocab(t) {
                by_token.entry(t).or_default().0 += 1;
            }
        }
    }
    out.extend(by_token.into_iter().map(|(t, (c, b))| (t, c, b)));
}

/// The sampled rows of a step from the output words (`rows` real rows; padding follows).
pub(super) fn unpack(
    out: &[i32],
    rows: &[SampleRow<'_>],
) -> Result<Vec<SampledToken>, EngineError> {
    let mut sampled = Vec::with_capacity(rows.len());
    for (r, row) in rows.iter().enumerate() {
        let o = &out[r * OUT_WORDS..(r + 1) * OUT_WORDS];
        if o[0] < 0 {
            return Err(EngineError::internal(if row.allowed.is_some() {
                "the allowed-token mask allows no token of the vocabulary"
            } else {
                "no token has a finite logit"
            }));
        }
        let n_top = (row.params.top_logprobs as usize).min(MAX_TOP);
        let top = (0..n_top)
            .map(|j| (o[2 + 2 * j], f32::from_bits(o[3 + 2 * j] as u32)))
            .take_while(|&(id, _)| id >= 0)
            .collect();
        sampled.push(SampledToken {
            token: o[0],
            logprob: f32::from_bits(o[1] as u32),
            top,
        });
    }
    Ok(sampled)
}

#[cfg(test)]
mod tests {
    use gantry_engine_abi::Sampling;

    use super::*;

    #[test]
    fn a_padded_decode_step_points_its_padding_at_the_dummy_block_and_skips_its_rows() {
        let tables: Vec<&[u32]> = vec![&[3, 5], &[7]];
        let input = StepInput {
            tokens: &[11, 12],
            positions: &[17, 2],
            seq_of: &[0, 1],
            tables: &tables,
            logits_rows: &[0, 1],
            adapters: &[],
            slots: &[],
        };
        let greedy = Sampling::greedy();
        let biased = Sampling {
            logit_bias: vec![(4, 1.5), (99, 2.0)],
            presence_penalty: 0.5,
            ..Sampling::greedy()
        };
        let mask = [0b1010u32];
        let rows = [
            SampleRow {
                params: &greedy,
                allowed: None,
                generated: &[],
                draw: 0,
            },
            SampleRow {
                params: &biased,
                allowed: Some(&mask),
                generated: &[4, 6, 4],
                draw: 9,
            },
        ];
        let mut w = Vec::new();
        let pad = Padding {
            to: 4,
            dummy_block: 9,
        };
        let p = pack(&mut w, &input, &rows, Some(&pad), 16, 40).expect("pack");
        assert_eq!(
            (p.n_tokens, p.n_rows, p.identity_rows, p.n_adj),
            (4, 4, true, 2)
        );
        let sec = |i: usize| &w[w[i] as usize..];
        assert_eq!(&sec(IN_TOKENS)[..4], &[11, 12, 0, 0]);
        // Position 17 of table [3, 5] with 16-token blocks is cell 5 * 16 + 1.
        assert_eq!(&sec(IN_CELLS)[..4], &[81, 7 * 16 + 2, 144, 144]);
        assert_eq!(&sec(IN_SEQ_OF)[..4], &[0, 1, 2, 2]);
        assert_eq!(&sec(IN_TABLE_OFF)[..3], &[0, 2, 3]);
        assert_eq!(&sec(IN_TABLES)[..4], &[3, 5, 7, 9]);
        let params = sec(IN_PARAMS);
        assert_eq!(params[0], F_GREEDY);
        assert_eq!(params[P_WORDS + 10], 9, "the draw counter");
        assert_eq!(params[2 * P_WORDS], F_SKIP);
        assert_eq!(params[3 * P_WORDS], F_SKIP);
        // Row 1: token 4 biased and generated twice, token 6 generated once; 99 is outside
        // the 40-token vocabulary.
        assert_eq!(
            (
                params[P_WORDS + 12],
                params[P_WORDS + 13],
                params[P_WORDS + 14]
            ),
            (0, 2, 0)
        );
        assert_eq!(&sec(IN_ADJ)[..6], &[4, 2, f(1.5), 6, 1, f(0.0)]);
        assert_eq!(
            &sec(IN_MASKS)[..2],
            &[0b1010, 0],
            "a mask is padded to the vocabulary"
        );
        assert_eq!(w[IN_MASK_WORDS], 2);
    }
}
