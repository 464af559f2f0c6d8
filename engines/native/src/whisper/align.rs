//! Whisper's word timing (engine side of ABI 1.11 `seq_token_times`, after a sequence's
//! decoding): the cross-attention of the checkpoint's alignment heads over the audio, from a
//! decoder pass over the sequence's text as openai-whisper's `find_alignment` makes it
//! (`whisper/mod.rs`), turned into one time per token as it does — a softmax over the
//! positions that hold audio, each head normalised over the tokens, a median filter of width
//! 7 along the audio, the heads averaged, and dynamic time warping from the tokens to the
//! audio.

use super::net::SOURCE_POSITIONS;

/// Encoder positions per second of audio (1,500 over 30 s).
pub const POSITIONS_PER_SECOND: f32 = 50.0;

/// openai-whisper's median filter width.
const MEDIAN_WIDTH: usize = 7;

/// One time (seconds) per row of `rows` in `path` — each row the alignment heads' scores of
/// one token, `[head][SOURCE_POSITIONS]` — over the first `positions` encoder positions (those
/// that hold audio): where the row's token first reaches along the path. The normalisation and
/// the filter see every row, as openai-whisper's do (its start of transcript, language and
/// task, and end of text among them); the warping only the rows of `path`.
pub fn times(
    rows: &[Vec<f32>],
    path: std::ops::Range<usize>,
    positions: usize,
    heads: usize,
) -> Vec<f32> {
    if path.is_empty() || path.end > rows.len() || heads == 0 {
        return Vec::new();
    }
    let (n, f) = (rows.len(), positions.clamp(1, SOURCE_POSITIONS));
    let mut matrix = vec![0.0f32; n * f];
    let mut w = vec![0.0f32; n * f];
    for h in 0..heads {
        // Softmax over the audio's positions.
        for (r, row) in rows.iter().enumerate() {
            let s = &row[h * SOURCE_POSITIONS..h * SOURCE_POSITIONS + f];
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let dst = &mut w[r * f..(r + 1) * f];
            let mut sum = 0.0;
            for (d, &v) in dst.iter_mut().zip(s) {
                *d = (v - max).exp();
                sum += *d;
            }
            dst.iter_mut().for_each(|d| *d /= sum);
        }
        // Each position normalised over the tokens (mean 0, population std 1).
        for j in 0..f {
            let mean = (0..n).map(|r| w[r * f + j]).sum::<f32>() / n as f32;
            let var = (0..n).map(|r| (w[r * f + j] - mean).powi(2)).sum::<f32>() / n as f32;
            let std = var.sqrt().max(f32::MIN_POSITIVE);
            (0..n).for_each(|r| w[r * f + j] = (w[r * f + j] - mean) / std);
        }
        for r in 0..n {
            let filtered = median_filter(&w[r * f..(r + 1) * f]);
            for (m, v) in matrix[r * f..(r + 1) * f].iter_mut().zip(filtered) {
                *m += v / heads as f32;
            }
        }
    }
    let n = path.len();
    let path = dtw(&matrix[path.start * f..path.end * f], n, f);
    // The first audio position each token reaches.
    let mut times = vec![0.0f32; n];
    let mut last = usize::MAX;
    for (i, j) in path {
        if i != last {
            times[i] = j as f32 / POSITIONS_PER_SECOND;
            last = i;
        }
    }
    times
}

/// Encoder positions that hold audio of `samples` samples at 16 kHz (320 per position; the
/// last, partial one left out as openai-whisper's `num_frames // 2` does).
pub fn positions(samples: usize) -> usize {
    (samples / 320).clamp(1, SOURCE_POSITIONS)
}

/// The median of each width-7 window along `x`, its ends reflected (as openai-whisper pads);
/// a row too short to reflect is left as it is.
fn median_filter(x: &[f32]) -> Vec<f32> {
    let p = MEDIAN_WIDTH / 2;
    let n = x.len();
    if n <= p {
        return x.to_vec();
    }
    let at = |i: isize| -> f32 {
        let i = if i < 0 {
            -i
        } else if i >= n as isize {
            2 * (n as isize - 1) - i
        } else {
            i
        };
        x[i as usize]
    };
    let mut win = [0.0f32; MEDIAN_WIDTH];
    (0..n)
        .map(|c| {
            for (k, v) in win.iter_mut().enumerate() {
                *v = at(c as isize + k as isize - p as isize);
            }
            win.sort_unstable_by(f32::total_cmp);
            win[p]
        })
        .collect()
}

/// Dynamic time warping of the tokens (`n` rows) to the audio (`f` columns) over the cost
/// `-matrix`, as openai-whisper's `dtw_cpu` and `backtrace`: the path's (row, column) pairs,
/// first to last.
fn dtw(matrix: &[f32], n: usize, f: usize) -> Vec<(usize, usize)> {
    let w = f + 1;
    let mut cost = vec![f64::INFINITY; (n + 1) * w];
    let mut trace = vec![-1i8; (n + 1) * w];
    cost[0] = 0.0;
    for j in 1..=f {
        for i in 1..=n {
            let (c0, c1, c2) = (
                cost[(i - 1) * w + j - 1],
                cost[(i - 1) * w + j],
                cost[i * w + j - 1],
            );
            let (c, t) = if c0 < c1 && c0 < c2 {
                (c0, 0)
            } else if c1 < c0 && c1 < c2 {
                (c1, 1)
            } else {
                (c2, 2)
            };
            cost[i * w + j] = -f64::from(matrix[(i - 1) * f + j - 1]) + c;
            trace[i * w + j] = t;
        }
    }
    (0..w).for_each(|j| trace[j] = 2);
    (0..=n).for_each(|i| trace[i * w] = 1);
    let (mut i, mut j) = (n, f);
    let mut path = Vec::with_capacity(n + f);
    while i > 0 || j > 0 {
        path.push((i - 1, j.saturating_sub(1)));
        match trace[i * w + j] {
            0 => {
                i -= 1;
                j -= 1;
            }
            1 => i -= 1,
            _ => j -= 1,
        }
    }
    path.reverse();
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_follows_the_strongest_diagonal() {
        // Three tokens over nine positions, each token's weight on its own third.
        let (n, f) = (3, 9);
        let m: Vec<f32> = (0..n * f)
            .map(|k| if (k % f) / 3 == k / f { 1.0 } else { 0.0 })
            .collect();
        let path = dtw(&m, n, f);
        assert_eq!(path.first(), Some(&(0, 0)));
        assert_eq!(path.last(), Some(&(2, 8)));
        let first_col: Vec<usize> = (0..n)
            .map(|i| path.iter().find(|p| p.0 == i).expect("row").1)
            .collect();
        // Each token enters its third within a position (a tie between entering and staying
        // goes to staying, as openai-whisper's comparison has it).
        assert!(
            first_col
                .iter()
                .zip([0i64, 3, 6])
                .all(|(&c, w)| (c as i64 - w).abs() <= 1),
            "{first_col:?}"
        );
    }

    #[test]
    fn median_of_seven_with_reflected_ends() {
        let x = [5.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0];
        let m = median_filter(&x);
        // Position 0 sees 2, 9, 1, 5, 1, 9, 2 (reflected): the median is 2.
        assert_eq!(m[0], 2.0);
        // Position 3 sees 5, 1, 9, 2, 8, 3, 7: 5.
        assert_eq!(m[3], 5.0);
        assert_eq!(median_filter(&[1.0, 2.0]), vec![1.0, 2.0]);
    }

    #[test]
    fn times_move_forward_with_the_attention() {
        // Two heads; three tokens attending to positions 5-14, 15-24 and 25-34 of 1 s of
        // audio (bands, since the median filter removes a lone peak).
        let mut rows = Vec::new();
        for band in [5usize, 15, 25] {
            let mut row = vec![0.0f32; 2 * SOURCE_POSITIONS];
            for h in 0..2 {
                for p in band..band + 10 {
                    row[h * SOURCE_POSITIONS + p] = 8.0;
                }
            }
            rows.push(row);
        }
        let t = times(&rows, 0..3, positions(16_000), 2);
        let want = [0.0, 0.3, 0.5];
        assert!(
            t.iter().zip(want).all(|(a, b)| (a - b).abs() < 0.061),
            "{t:?}"
        );
        // Warping the last two rows only: the first of them starts at 0.
        let t = times(&rows, 1..3, positions(16_000), 2);
        assert!(
            t.len() == 2 && t[0] == 0.0 && (t[1] - 0.5).abs() < 0.061,
            "{t:?}"
        );
        assert_eq!(times(&[], 0..0, 50, 2), Vec::<f32>::new());
    }
}
