//! Uploaded audio into samples (the speech recognition route, `http/audio.rs`, before the
//! scheduler): any wav, flac, mp3 or ogg/vorbis file decoded by symphonia, mixed down to mono,
//! resampled by rubato to the rate the model takes (16 kHz for Whisper). What cannot be read
//! is a clear error naming the reason; audio past the duration limit is refused while it is
//! decoded, before it is all in memory. And synthesized speech out of samples (the speech
//! route, `http/speech.rs`): 16-bit PCM, its WAV header, and FLAC (flacenc).

use rubato::{FftFixedIn, Resampler};
use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{CODEC_TYPE_NULL, DecoderOptions};
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

/// Why an upload gives no samples.
#[derive(Debug, PartialEq)]
pub enum AudioError {
    /// Not audio this node reads (the reason), or a damaged file.
    Unreadable(String),
    /// Longer than the limit (seconds).
    TooLong { limit_secs: u32 },
    /// No samples at all.
    Empty,
}

impl std::fmt::Display for AudioError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AudioError::Unreadable(why) => write!(
                f,
                "the file is not audio this node reads (wav, flac, mp3, ogg/vorbis): {why}"
            ),
            AudioError::TooLong { limit_secs } => write!(
                f,
                "the audio is longer than {limit_secs} s, the most this node transcribes in one request"
            ),
            AudioError::Empty => write!(f, "the audio holds no samples"),
        }
    }
}

/// Mono samples at `rate`, and the audio's duration in seconds.
pub struct Decoded {
    pub samples: Vec<f32>,
    pub seconds: f64,
}

/// Decode `bytes` (the upload; `filename` only hints at the container) into mono samples at
/// `rate`, refusing audio longer than `limit_secs`.
pub fn decode(
    bytes: Vec<u8>,
    filename: Option<&str>,
    rate: u32,
    limit_secs: u32,
) -> Result<Decoded, AudioError> {
    let unreadable = |e: SymphoniaError| AudioError::Unreadable(e.to_string());
    let mut hint = Hint::new();
    if let Some(ext) = filename.and_then(|f| f.rsplit_once('.')).map(|(_, e)| e) {
        hint.with_extension(ext);
    }
    let source = MediaSourceStream::new(Box::new(std::io::Cursor::new(bytes)), Default::default());
    let probed = symphonia::default::get_probe()
        .format(
            &hint,
            source,
            &FormatOptions::default(),
            &MetadataOptions::default(),
        )
        .map_err(unreadable)?;
    let mut format = probed.format;
    let track = format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| AudioError::Unreadable("no audio track".into()))?;
    let (track_id, source_rate) = (
        track.id,
        track
            .codec_params
            .sample_rate
            .ok_or_else(|| AudioError::Unreadable("no sample rate".into()))?,
    );
    let mut decoder = symphonia::default::get_codecs()
        .make(&track.codec_params, &DecoderOptions::default())
        .map_err(unreadable)?;
    let limit = u64::from(limit_secs) * u64::from(source_rate);
    let mut mono: Vec<f32> = Vec::new();
    loop {
        let packet = match format.next_packet() {
            Ok(p) => p,
            Err(SymphoniaError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break;
            }
            Err(e) => return Err(unreadable(e)),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let decoded = match decoder.decode(&packet) {
            Ok(d) => d,
            // A damaged packet is skipped, as players do; a file of nothing else ends empty.
            Err(SymphoniaError::DecodeError(_)) => continue,
            Err(e) => return Err(unreadable(e)),
        };
        let spec = *decoded.spec();
        let channels = spec.channels.count().max(1);
        let mut buf = SampleBuffer::<f32>::new(decoded.capacity() as u64, spec);
        buf.copy_interleaved_ref(decoded);
        mono.extend(
            buf.samples()
                .chunks_exact(channels)
                .map(|frame| frame.iter().sum::<f32>() / channels as f32),
        );
        if mono.len() as u64 > limit {
            return Err(AudioError::TooLong { limit_secs });
        }
    }
    if mono.is_empty() {
        return Err(AudioError::Empty);
    }
    let seconds = mono.len() as f64 / f64::from(source_rate);
    let samples = resample(&mono, source_rate, rate)
        .map_err(|e| AudioError::Unreadable(format!("resampling: {e}")))?;
    Ok(Decoded { samples, seconds })
}

/// `input` at `from` Hz as `to` Hz (rubato's FFT resampler; the input as is when equal).
pub fn resample(input: &[f32], from: u32, to: u32) -> Result<Vec<f32>, String> {
    if from == to {
        return Ok(input.to_vec());
    }
    let mut r = FftFixedIn::<f32>::new(from as usize, to as usize, 1024, 2, 1)
        .map_err(|e| e.to_string())?;
    let want = (input.len() as u64 * u64::from(to)).div_ceil(u64::from(from)) as usize;
    let delay = r.output_delay();
    let mut out = Vec::with_capacity(want + delay + 2048);
    let mut at = 0;
    while input.len() - at >= r.input_frames_next() {
        let n = r.input_frames_next();
        let chunk = r
            .process(&[&input[at..at + n]], None)
            .map_err(|e| e.to_string())?;
        out.extend_from_slice(&chunk[0]);
        at += n;
    }
    // rubato refuses an empty partial chunk: input that filled its last chunk exactly has
    // nothing left here, and goes straight to the flush.
    if at < input.len() {
        let chunk = r
            .process_partial(Some(&[&input[at..]]), None)
            .map_err(|e| e.to_string())?;
        out.extend_from_slice(&chunk[0]);
    }
    // Flush what the filter still holds.
    while out.len() < want + delay {
        let chunk = r
            .process_partial::<&[f32]>(None, None)
            .map_err(|e| e.to_string())?;
        if chunk[0].is_empty() {
            break;
        }
        out.extend_from_slice(&chunk[0]);
    }
    let end = (delay + want).min(out.len());
    Ok(out[delay.min(end)..end].to_vec())
}

/// A sample in [-1, 1] as 16 bits: scaled by 32767, clipped, truncated toward zero (as Piper
/// and NumPy's `astype(int16)` do, so the node's output matches theirs).
fn sample16(s: f32) -> i16 {
    (s * 32767.0).clamp(-32767.0, 32767.0) as i16
}

/// Samples in [-1, 1] as 16-bit little-endian PCM ([`sample16`] each).
pub fn pcm16(samples: &[f32]) -> Vec<u8> {
    samples
        .iter()
        .flat_map(|&s| sample16(s).to_le_bytes())
        .collect()
}

/// The 44-byte RIFF/WAVE header of 16-bit PCM at `rate`, `channels` interleaved, before
/// `data_bytes` of samples; `None` when the length is not known yet (a stream), written as
/// the largest size, as streaming servers do. Written here rather than with a WAV crate: the
/// header is fixed and a stream needs it before the samples exist.
pub fn wav_header(rate: u32, channels: u16, data_bytes: Option<u32>) -> Vec<u8> {
    let data = data_bytes.unwrap_or(u32::MAX - 36);
    let mut w = Vec::with_capacity(44);
    w.extend_from_slice(b"RIFF");
    w.extend_from_slice(&(36 + data).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt ");
    w.extend_from_slice(&16u32.to_le_bytes());
    w.extend_from_slice(&1u16.to_le_bytes());
    w.extend_from_slice(&channels.to_le_bytes());
    w.extend_from_slice(&rate.to_le_bytes());
    w.extend_from_slice(&(rate * u32::from(channels) * 2).to_le_bytes());
    w.extend_from_slice(&(channels * 2).to_le_bytes());
    w.extend_from_slice(&16u16.to_le_bytes());
    w.extend_from_slice(b"data");
    w.extend_from_slice(&data.to_le_bytes());
    w
}

/// Samples in [-1, 1] as a FLAC file of 16-bit mono at `rate`: the same samples as
/// [`pcm16`], losslessly compressed (flacenc, its default encoder settings).
pub fn flac(samples: &[f32], rate: u32) -> Result<Vec<u8>, String> {
    use flacenc::component::BitRepr;
    use flacenc::error::Verify;
    let ints: Vec<i32> = samples.iter().map(|&s| i32::from(sample16(s))).collect();
    let config = flacenc::config::Encoder::default()
        .into_verified()
        .map_err(|(_, e)| format!("FLAC encoder settings: {e:?}"))?;
    let source = flacenc::source::MemSource::from_samples(&ints, 1, 16, rate as usize);
    let stream = flacenc::encode_with_fixed_block_size(&config, source, config.block_size)
        .map_err(|e| format!("FLAC encoding: {e:?}"))?;
    let mut sink = flacenc::bitsink::ByteSink::new();
    stream
        .write(&mut sink)
        .map_err(|e| format!("FLAC writing: {e:?}"))?;
    let mut file = sink.as_slice().to_vec();
    // STREAMINFO's minimum block size excludes the last block (the FLAC format's rule), but
    // flacenc records the short last block's size there, which makes the stream look variable
    // in block size and readers (symphonia among them) refuse it. Every block but the last is
    // `block_size` long: write that (bytes 8-9, after "fLaC" and the block header; the
    // maximum follows at 10-11; STREAMINFO has no checksum of its own).
    if ints.len() > config.block_size && file.len() >= 12 && &file[..4] == b"fLaC" {
        let max = [file[10], file[11]];
        file[8..10].copy_from_slice(&max);
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 16-bit PCM wav of `samples` at `rate`, `channels` interleaved.
    pub fn wav(samples: &[f32], rate: u32, channels: u16) -> Vec<u8> {
        let data = pcm16(samples);
        let mut w = wav_header(rate, channels, Some(data.len() as u32));
        w.extend_from_slice(&data);
        w
    }

    #[test]
    fn flac_holds_exactly_the_16_bit_samples() {
        let t = tone(440.0, 22_050, 1.5);
        let file = flac(&t, 22_050).expect("encoded");
        assert_eq!(&file[..4], b"fLaC");
        assert!(
            file.len() < pcm16(&t).len(),
            "compressed: {} bytes",
            file.len()
        );
        let back = decode(file, Some("speech.flac"), 22_050, 60).expect("decoded");
        let want: Vec<i16> = t.iter().map(|&s| sample16(s)).collect();
        let got: Vec<i16> = back
            .samples
            .iter()
            .map(|s| (s * 32768.0).round() as i16)
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn input_that_fills_its_last_chunk_exactly_is_resampled() {
        // 30 chunks of 1024 frames at 22.05 kHz (a Piper voice's rate) to Whisper's 16 kHz.
        for n in [1024 * 30, 1024 * 30 - 1, 1024 * 30 + 1, 1] {
            let out = resample(&vec![0.1f32; n], 22_050, 16_000).expect("resampled");
            assert_eq!(out.len(), (n * 16_000).div_ceil(22_050), "{n} frames");
        }
    }

    fn tone(hz: f32, rate: u32, secs: f32) -> Vec<f32> {
        (0..(rate as f32 * secs) as usize)
            .map(|i| 0.5 * (2.0 * std::f32::consts::PI * hz * i as f32 / rate as f32).sin())
            .collect()
    }

    #[test]
    fn a_stereo_wav_at_44_1_khz_becomes_16_khz_mono_of_the_same_tone() {
        let left = tone(440.0, 44_100, 1.0);
        let stereo: Vec<f32> = left.iter().flat_map(|s| [*s, *s]).collect();
        let d = decode(wav(&stereo, 44_100, 2), Some("a.wav"), 16_000, 60).expect("decode");
        assert!((d.seconds - 1.0).abs() < 1e-3, "{}", d.seconds);
        assert_eq!(d.samples.len(), 16_000);
        // The same tone at the new rate, away from the ends.
        let want = tone(440.0, 16_000, 1.0);
        let worst = d.samples[1000..15_000]
            .iter()
            .zip(&want[1000..15_000])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 0.01, "{worst}");
    }

    #[test]
    fn what_is_not_audio_too_long_or_empty_is_refused_with_the_reason() {
        let e = decode(b"not audio at all".to_vec(), Some("x.mp3"), 16_000, 60)
            .err()
            .expect("garbage");
        assert!(matches!(e, AudioError::Unreadable(_)), "{e:?}");
        assert!(e.to_string().contains("wav, flac, mp3"), "{e}");
        let e = decode(wav(&tone(100.0, 8_000, 3.0), 8_000, 1), None, 16_000, 2)
            .err()
            .expect("too long");
        assert_eq!(e, AudioError::TooLong { limit_secs: 2 });
        let e = decode(wav(&[], 16_000, 1), None, 16_000, 2)
            .err()
            .expect("empty");
        assert_eq!(e, AudioError::Empty);
    }
}
