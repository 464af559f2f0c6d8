//! Uploaded audio into samples (the speech recognition route, `http/audio.rs`, before the
//! scheduler): any wav, flac, mp3, ogg (vorbis or opus) or webm (opus, what browsers record)
//! file demuxed by symphonia, decoded by symphonia or libopus, mixed down to mono,
//! resampled by rubato to the rate the model takes (16 kHz for Whisper). What cannot be read
//! is a clear error naming the reason; audio past the duration limit is refused while it is
//! decoded, before it is all in memory. Synthesized speech into the bytes of an answer is
//! [`encode`].

pub mod encode;

use rubato::{FftFixedIn, Resampler};
use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{CODEC_TYPE_NULL, CODEC_TYPE_OPUS, DecoderOptions};
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
                "the file is not audio this node reads (wav, flac, mp3, ogg (vorbis, opus), webm (opus)): {why}"
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

/// Opus decodes at 48 kHz, whatever rate was fed to its encoder.
const OPUS_RATE: u32 = 48_000;

/// What turns a track's packets into samples: symphonia's decoders, and libopus (through the
/// `opus` crate) for Opus, which symphonia demuxes from Ogg and WebM but does not decode.
enum Codec {
    Symphonia(Box<dyn symphonia::core::codecs::Decoder>),
    Opus(Box<OpusTrack>),
}

impl Codec {
    fn new(params: &symphonia::core::codecs::CodecParameters) -> Result<Codec, AudioError> {
        if params.codec == CODEC_TYPE_OPUS {
            return OpusTrack::new(params).map(|o| Codec::Opus(Box::new(o)));
        }
        symphonia::default::get_codecs()
            .make(params, &DecoderOptions::default())
            .map(Codec::Symphonia)
            .map_err(|e| AudioError::Unreadable(e.to_string()))
    }
}

/// An Opus track: its decoder, the samples still to drop at the start (the pre-skip of its
/// `OpusHead`), and one packet's samples mixed down to mono.
struct OpusTrack {
    decoder: opus::Decoder,
    channels: usize,
    skip: usize,
    /// The `OpusHead`'s output gain, as a factor.
    gain: f32,
    frame: Vec<f32>,
    mono: Vec<f32>,
}

impl OpusTrack {
    fn new(params: &symphonia::core::codecs::CodecParameters) -> Result<OpusTrack, AudioError> {
        let head = params.extra_data.as_deref().unwrap_or_default();
        if head.len() < 19 || &head[..8] != b"OpusHead" {
            return Err(AudioError::Unreadable(
                "an Opus track without its OpusHead".into(),
            ));
        }
        if head[18] != 0 {
            return Err(AudioError::Unreadable(format!(
                "Opus with channel mapping family {} (family 0, mono or stereo, is read)",
                head[18]
            )));
        }
        let (channels, skip) = match head[9] {
            1 => (opus::Channels::Mono, 1),
            2 => (opus::Channels::Stereo, 2),
            n => {
                return Err(AudioError::Unreadable(format!(
                    "Opus with {n} channels (mono and stereo are read)"
                )));
            }
        };
        let decoder = opus::Decoder::new(OPUS_RATE, channels)
            .map_err(|e| AudioError::Unreadable(format!("Opus decoder: {e}")))?;
        Ok(OpusTrack {
            decoder,
            channels: skip,
            skip: usize::from(u16::from_le_bytes([head[10], head[11]])),
            // Q7.8 decibels.
            gain: 10f32.powf(f32::from(i16::from_le_bytes([head[16], head[17]])) / 256.0 / 20.0),
            // 120 ms at 48 kHz, Opus's longest packet.
            frame: vec![0.0; 5760 * skip],
            mono: Vec::new(),
        })
    }

    /// One packet's samples in mono, after the pre-skip; `None` for a damaged packet.
    fn decode(&mut self, packet: &[u8]) -> Option<&[f32]> {
        let n = self
            .decoder
            .decode_float(packet, &mut self.frame, false)
            .ok()?;
        let c = self.channels;
        self.mono.clear();
        self.mono.extend(
            self.frame[..n * c]
                .chunks_exact(c)
                .map(|f| f.iter().sum::<f32>() / c as f32 * self.gain),
        );
        let drop = self.skip.min(self.mono.len());
        self.skip -= drop;
        Some(&self.mono[drop..])
    }
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
    let track_id = track.id;
    let mut decoder = Codec::new(&track.codec_params)?;
    let source_rate = match &decoder {
        Codec::Opus(_) => OPUS_RATE,
        Codec::Symphonia(_) => track
            .codec_params
            .sample_rate
            .ok_or_else(|| AudioError::Unreadable("no sample rate".into()))?,
    };
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
        let decoder = match &mut decoder {
            Codec::Opus(o) => {
                // A damaged packet is skipped, as players do.
                if let Some(samples) = o.decode(packet.buf()) {
                    mono.extend_from_slice(samples);
                }
                if mono.len() as u64 > limit {
                    return Err(AudioError::TooLong { limit_secs });
                }
                continue;
            }
            Codec::Symphonia(d) => d,
        };
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

#[cfg(test)]
mod tests {
    use super::encode::{pcm16, wav_header};
    use super::*;

    /// A 16-bit PCM wav of `samples` at `rate`, `channels` interleaved.
    fn wav(samples: &[f32], rate: u32, channels: u16) -> Vec<u8> {
        let data = pcm16(samples);
        let mut w = wav_header(rate, channels, Some(data.len() as u32));
        w.extend_from_slice(&data);
        w
    }

    #[test]
    fn input_that_fills_its_last_chunk_exactly_is_resampled() {
        // 30 chunks of 1024 frames at 22.05 kHz (a Piper voice's rate) to Whisper's 16 kHz.
        for n in [1024 * 30, 1024 * 30 - 1, 1024 * 30 + 1, 1] {
            let out = resample(&vec![0.1f32; n], 22_050, 16_000).expect("resampled");
            assert_eq!(out.len(), (n * 16_000).div_ceil(22_050), "{n} frames");
        }
    }

    pub(super) fn tone(hz: f32, rate: u32, secs: f32) -> Vec<f32> {
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

    /// An EBML element: its ID, its size as an 8-byte variable-length integer, its body.
    fn ebml(id: u32, body: &[u8]) -> Vec<u8> {
        let mut e: Vec<u8> = id
            .to_be_bytes()
            .into_iter()
            .skip_while(|&b| b == 0)
            .collect();
        e.push(0x01);
        e.extend_from_slice(&(body.len() as u64).to_be_bytes()[1..]);
        e.extend_from_slice(body);
        e
    }

    #[test]
    fn opus_in_webm_as_browsers_record_it_is_read() {
        // Two seconds of a tone as 20 ms Opus packets in a WebM file laid out as a browser's
        // MediaRecorder writes one: EBML header, a segment of unknown size, segment info, one
        // A_OPUS track, clusters of unknown size holding SimpleBlocks.
        let t = tone(440.0, 48_000, 2.0);
        let mut enc = opus::Encoder::new(48_000, opus::Channels::Mono, opus::Application::Audio)
            .expect("encoder");
        let pre_skip = enc.get_lookahead().expect("look-ahead") as u16;
        let mut head = b"OpusHead".to_vec();
        head.extend_from_slice(&[1, 1]);
        head.extend_from_slice(&pre_skip.to_le_bytes());
        head.extend_from_slice(&48_000u32.to_le_bytes());
        head.extend_from_slice(&[0, 0, 0]);
        let int = |id: u32, v: u64| ebml(id, &v.to_be_bytes());
        let header = [
            int(0x4286, 1),
            int(0x42F7, 1),
            int(0x42F2, 4),
            int(0x42F3, 8),
            ebml(0x4282, b"webm"),
            int(0x4287, 4),
            int(0x4285, 2),
        ]
        .concat();
        let info = ebml(
            0x1549_A966,
            &[int(0x2A_D7B1, 1_000_000), ebml(0x4D80, b"test")].concat(),
        );
        let audio = ebml(
            0xE1,
            &[ebml(0xB5, &48_000f64.to_be_bytes()), int(0x9F, 1)].concat(),
        );
        let track = [
            int(0xD7, 1),
            int(0x73C5, 1),
            int(0x83, 2),
            ebml(0x86, b"A_OPUS"),
            ebml(0x63A2, &head),
            audio,
        ]
        .concat();
        let tracks = ebml(0x1654_AE6B, &ebml(0xAE, &track));
        // A cluster a second (50 blocks), each opened with an unknown size, as the segment is:
        // a recorder writes them before it knows how long they get.
        let open = |id: u32| {
            let mut e: Vec<u8> = id.to_be_bytes().to_vec();
            e.extend_from_slice(&[0x01, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]);
            e
        };
        let mut clusters = Vec::new();
        let mut packet = vec![0u8; 4000];
        for (i, frame) in t
            .chunks(960)
            .chain(std::iter::once(&[0f32; 960][..]))
            .enumerate()
        {
            if i % 50 == 0 {
                clusters.extend(open(0x1F43_B675));
                clusters.extend(int(0xE7, (i * 20) as u64));
            }
            let mut f = frame.to_vec();
            f.resize(960, 0.0);
            let n = enc.encode_float(&f, &mut packet).expect("packet");
            let mut block = vec![0x81];
            block.extend_from_slice(&(((i % 50) * 20) as i16).to_be_bytes());
            block.push(0x80);
            block.extend_from_slice(&packet[..n]);
            clusters.extend(ebml(0xA3, &block));
        }
        let segment = [open(0x1853_8067), info, tracks, clusters].concat();
        let file = [ebml(0x1A45_DFA3, &header), segment].concat();
        let back = decode(file, Some("recording.webm"), 16_000, 60).expect("decoded");
        // The pre-skip is dropped; the last packet's padding (under 20 ms) stays.
        assert!((2.0..2.021).contains(&back.seconds), "{} s", back.seconds);
        let want = tone(440.0, 16_000, 2.0);
        let e = (1_600..30_000)
            .map(|i| (back.samples[i] - want[i]).abs())
            .fold(0.0f32, f32::max);
        assert!(e < 0.05, "{e}");
    }
}
