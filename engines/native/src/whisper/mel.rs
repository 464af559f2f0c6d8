//! Native engine, Whisper's front end (`seq_set_input`, before the encoder): 16 kHz audio
//! into the log-mel features Whisper was trained on, as transformers' `WhisperFeatureExtractor`
//! computes them.
//!
//! The audio is padded with zeros to 30 s (or cut there), framed every 160 samples with a
//! 400-sample periodic Hann window centred on the frame (the signal reflected at both ends),
//! turned into a power spectrum (201 bins), projected onto `n_mels` triangular mel filters
//! (Slaney's mel scale and area normalisation, 0–8 kHz), and log10'd with a floor of 1e-10;
//! the last frame is dropped (3,000 remain), values below the maximum minus 8 are raised to
//! it, and the result is scaled as `(x + 4) / 4`.

use std::sync::Arc;

use rustfft::num_complex::Complex;
use rustfft::{Fft, FftPlanner};

pub const SAMPLE_RATE: u32 = 16_000;
/// Samples in Whisper's window of 30 s.
pub const WINDOW_SAMPLES: usize = 480_000;
const N_FFT: usize = 400;
const HOP: usize = 160;
/// Frames in 30 s (one more is computed and dropped, as transformers does).
pub const FRAMES: usize = WINDOW_SAMPLES / HOP;
const BINS: usize = N_FFT / 2 + 1;

/// The filters and the transform, made once per model.
pub struct LogMel {
    n_mels: usize,
    /// `[n_mels][BINS]`.
    filters: Vec<f32>,
    window: Vec<f32>,
    fft: Arc<dyn Fft<f32>>,
}

/// Slaney's mel scale: linear below 1 kHz, logarithmic above.
fn hz_to_mel(hz: f64) -> f64 {
    let min_log_mel = 15.0;
    if hz < 1000.0 {
        3.0 * hz / 200.0
    } else {
        min_log_mel + (hz / 1000.0).ln() * 27.0 / 6.4f64.ln()
    }
}

fn mel_to_hz(mel: f64) -> f64 {
    if mel < 15.0 {
        200.0 * mel / 3.0
    } else {
        1000.0 * ((mel - 15.0) * 6.4f64.ln() / 27.0).exp()
    }
}

impl LogMel {
    pub fn new(n_mels: usize) -> Self {
        // Filter edges evenly spaced in mel from 0 Hz to the Nyquist frequency.
        let (lo, hi) = (hz_to_mel(0.0), hz_to_mel(f64::from(SAMPLE_RATE) / 2.0));
        let edges: Vec<f64> = (0..n_mels + 2)
            .map(|i| mel_to_hz(lo + (hi - lo) * i as f64 / (n_mels + 1) as f64))
            .collect();
        let bin_hz = |b: usize| b as f64 * f64::from(SAMPLE_RATE) / 2.0 / (BINS - 1) as f64;
        let mut filters = vec![0.0f32; n_mels * BINS];
        for m in 0..n_mels {
            let (left, centre, right) = (edges[m], edges[m + 1], edges[m + 2]);
            // Slaney's normalisation: every filter has the same area.
            let norm = 2.0 / (right - left);
            for b in 0..BINS {
                let f = bin_hz(b);
                let up = (f - left) / (centre - left);
                let down = (right - f) / (right - centre);
                filters[m * BINS + b] = (up.min(down).max(0.0) * norm) as f32;
            }
        }
        let window = (0..N_FFT)
            .map(|n| {
                (0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / N_FFT as f64).cos()) as f32
            })
            .collect();
        Self {
            n_mels,
            filters,
            window,
            fft: FftPlanner::new().plan_fft_forward(N_FFT),
        }
    }

    /// `[n_mels][FRAMES]` features of `audio` (at most [`WINDOW_SAMPLES`] of it).
    pub fn features(&self, audio: &[f32]) -> Vec<f32> {
        use rayon::prelude::*;
        let mut padded = vec![0.0f32; WINDOW_SAMPLES];
        let n = audio.len().min(WINDOW_SAMPLES);
        padded[..n].copy_from_slice(&audio[..n]);
        // Centred frames: the signal reflected by half a frame at each end.
        let half = N_FFT / 2;
        let at = |i: isize| -> f32 {
            let len = WINDOW_SAMPLES as isize;
            let j = if i < 0 {
                -i
            } else if i >= len {
                2 * (len - 1) - i
            } else {
                i
            };
            padded[j as usize]
        };
        let mut logs = vec![0.0f32; self.n_mels * FRAMES];
        // Frame-major while computing, one frame per task.
        let frames: Vec<Vec<f32>> = (0..FRAMES)
            .into_par_iter()
            .map(|t| {
                let start = (t * HOP) as isize - half as isize;
                let mut buf: Vec<Complex<f32>> = (0..N_FFT)
                    .map(|k| Complex::new(at(start + k as isize) * self.window[k], 0.0))
                    .collect();
                self.fft.process(&mut buf);
                let power: Vec<f32> = buf[..BINS].iter().map(|c| c.norm_sqr()).collect();
                (0..self.n_mels)
                    .map(|m| {
                        let f = &self.filters[m * BINS..(m + 1) * BINS];
                        let e: f32 = f.iter().zip(&power).map(|(a, b)| a * b).sum();
                        e.max(1e-10).log10()
                    })
                    .collect()
            })
            .collect();
        for (t, frame) in frames.iter().enumerate() {
            for (m, v) in frame.iter().enumerate() {
                logs[m * FRAMES + t] = *v;
            }
        }
        let max = logs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for v in &mut logs {
            *v = (v.max(max - 8.0) + 4.0) / 4.0;
        }
        logs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mel_scale_is_linear_below_1_khz_and_inverts() {
        assert!((hz_to_mel(600.0) - 9.0).abs() < 1e-12);
        for hz in [0.0, 440.0, 1000.0, 3000.0, 8000.0] {
            assert!((mel_to_hz(hz_to_mel(hz)) - hz).abs() < 1e-6, "{hz}");
        }
    }

    #[test]
    fn a_tone_lights_the_filter_around_its_frequency() {
        let mel = LogMel::new(80);
        let tone: Vec<f32> = (0..16_000)
            .map(|i| (2.0 * std::f32::consts::PI * 1000.0 * i as f32 / 16_000.0).sin())
            .collect();
        let f = mel.features(&tone);
        let frame = 50;
        let column: Vec<f32> = (0..80).map(|m| f[m * FRAMES + frame]).collect();
        let best = (0..80)
            .max_by(|&a, &b| column[a].total_cmp(&column[b]))
            .expect("a filter");
        // 1 kHz is mel 15; 80 filters over 0..~45.2 mels put it near filter 25.
        assert!((24..=27).contains(&best), "{best}");
    }
}
