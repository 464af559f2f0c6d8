//! Synthesized speech into the bytes of an answer (the speech route, `http/speech.rs`, after
//! the scheduler hands over each piece of audio): 16-bit PCM, its WAV header, FLAC (flacenc),
//! MP3 (LAME, through `mp3lame-encoder`) and Opus in Ogg (libopus through `opus`, pages by
//! `ogg`). A [`Stream`] turns the pieces into bytes as they come, for the formats that can be
//! sent before the end is known (wav with an open length, pcm, mp3, opus); [`flac`] and a wav
//! of known length are made once all pieces are in.

use std::num::NonZeroU32;

use gantry_openai::validate::speech::SpeechFormat;

/// OpenAI's `pcm`: 24 kHz, 16-bit, mono.
pub const PCM_RATE: u32 = 24_000;

/// The rate Opus is fed at: one of the five rates libopus takes, and the nearest above every
/// Piper voice's (16 and 22.05 kHz), so a voice loses no band.
const OPUS_INPUT_RATE: u32 = 24_000;

/// 20 ms, Opus's usual frame, at [`OPUS_INPUT_RATE`].
const OPUS_FRAME: usize = 480;

/// Opus bit rate: speech at 24 kHz mono is transparent well below this.
const OPUS_BITS_PER_SECOND: i32 = 48_000;

/// libopus's effort, 0 to 10 (its default is 10). At 5 a voice served as Opus kept 91 % of
/// its real-time factor as wav, against 79 % at 10 (`docs/benchmarks.md`, text to speech).
const OPUS_COMPLEXITY: i32 = 5;

/// The Ogg stream's serial number (one stream per file, so any value serves).
const OGG_SERIAL: u32 = 0x6761_6e74;

/// A sample in [-1, 1] as 16 bits: scaled by 32767, clipped, truncated toward zero (as Piper
/// and NumPy's `astype(int16)` do, so the node's output matches theirs).
pub fn sample16(s: f32) -> i16 {
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

/// A wav file of `samples` at `rate` with its exact length.
pub fn wav(samples: &[f32], rate: u32) -> Vec<u8> {
    let data = pcm16(samples);
    let mut file = wav_header(rate, 1, Some(data.len() as u32));
    file.extend_from_slice(&data);
    file
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

/// One answer's encoder, fed the pieces of a speech in order.
pub struct Stream {
    /// The voice's sample rate.
    rate: u32,
    kind: Kind,
}

enum Kind {
    /// A wav header of open length, then 16-bit PCM at the voice's rate.
    Wav,
    /// 16-bit PCM at 24 kHz.
    Pcm,
    Mp3(Box<mp3lame_encoder::Encoder>),
    Opus(Box<OggOpus>),
}

impl Stream {
    /// An encoder for `format` (not `flac`, which is made whole) at the voice's `rate`.
    pub fn new(format: SpeechFormat, rate: u32) -> Result<Stream, String> {
        let kind = match format {
            SpeechFormat::Wav => Kind::Wav,
            SpeechFormat::Pcm => Kind::Pcm,
            SpeechFormat::Mp3 => Kind::Mp3(Box::new(mp3(rate)?)),
            SpeechFormat::Opus => Kind::Opus(Box::new(OggOpus::new()?)),
            SpeechFormat::Flac => return Err("FLAC is encoded whole, not streamed".into()),
        };
        Ok(Stream { rate, kind })
    }

    /// What comes before the first piece: the wav header, Opus's two header pages.
    pub fn start(&mut self) -> Result<Vec<u8>, String> {
        match &mut self.kind {
            Kind::Wav => Ok(wav_header(self.rate, 1, None)),
            Kind::Pcm | Kind::Mp3(_) => Ok(Vec::new()),
            Kind::Opus(o) => o.headers(),
        }
    }

    /// The bytes of one piece (an encoder may hold some back until the next or the end).
    pub fn piece(&mut self, samples: &[f32]) -> Result<Vec<u8>, String> {
        match &mut self.kind {
            Kind::Wav => Ok(pcm16(samples)),
            Kind::Pcm => super::resample(samples, self.rate, PCM_RATE)
                .map(|s| pcm16(&s))
                .map_err(|e| format!("resampling to 24 kHz: {e}")),
            Kind::Mp3(enc) => {
                let ints: Vec<i16> = samples.iter().map(|&s| sample16(s)).collect();
                let mut out =
                    Vec::with_capacity(mp3lame_encoder::max_required_buffer_size(ints.len()));
                enc.encode_to_vec(mp3lame_encoder::MonoPcm(&ints), &mut out)
                    .map_err(|e| format!("MP3 encoding: {e}"))?;
                Ok(out)
            }
            Kind::Opus(o) => {
                let at_24k = super::resample(samples, self.rate, OPUS_INPUT_RATE)
                    .map_err(|e| format!("resampling to 24 kHz: {e}"))?;
                o.push(&at_24k)
            }
        }
    }

    /// What ends the answer: the encoder's last frames.
    pub fn finish(&mut self) -> Result<Vec<u8>, String> {
        match &mut self.kind {
            Kind::Wav | Kind::Pcm => Ok(Vec::new()),
            Kind::Mp3(enc) => {
                // LAME's own bound for what a flush writes.
                let mut out = Vec::with_capacity(7200);
                enc.flush_to_vec::<mp3lame_encoder::FlushGap>(&mut out)
                    .map_err(|e| format!("MP3 encoding: {e}"))?;
                Ok(out)
            }
            Kind::Opus(o) => o.finish(),
        }
    }
}

/// A LAME encoder for mono at `rate`, 64 kbit/s constant (MPEG-2 layer III at a Piper voice's
/// 16 or 22.05 kHz), without LAME's own resampling and without a Xing/LAME tag, which needs
/// the whole file and so cannot lead a stream.
fn mp3(rate: u32) -> Result<mp3lame_encoder::Encoder, String> {
    let err = |e: mp3lame_encoder::BuildError| format!("MP3 encoder at {rate} Hz: {e}");
    let mut b = mp3lame_encoder::Builder::new().ok_or("LAME could not start")?;
    b.set_num_channels(1).map_err(err)?;
    b.set_sample_rate(rate).map_err(err)?;
    b.set_output_sample_rate(NonZeroU32::new(rate))
        .map_err(err)?;
    b.set_brate(mp3lame_encoder::Bitrate::Kbps64).map_err(err)?;
    b.set_quality(mp3lame_encoder::Quality::Good).map_err(err)?;
    b.set_to_write_vbr_tag(false).map_err(err)?;
    b.build().map_err(err)
}

/// Opus in Ogg as RFC 7845 lays it out: an `OpusHead` page, an `OpusTags` page, then 20 ms
/// packets, a page per piece so each piece leaves as soon as it is encoded; the last page's
/// granule position trims the padding of the last frame, and the pre-skip the encoder's
/// look-ahead, so a decoder gives back exactly the samples fed in.
struct OggOpus {
    encoder: opus::Encoder,
    pages: ogg::writing::PacketWriter<'static, Vec<u8>>,
    /// Samples not yet a whole frame, at [`OPUS_INPUT_RATE`].
    pending: Vec<f32>,
    /// Samples fed so far, at [`OPUS_INPUT_RATE`].
    fed: u64,
    /// Frames encoded so far.
    frames: u64,
    /// The encoder's look-ahead at 48 kHz (the granule positions' rate).
    pre_skip: u16,
    /// One encoded packet (libopus's recommended bound).
    packet: Vec<u8>,
    /// The last page is written: nothing may follow it.
    ended: bool,
}

impl OggOpus {
    fn new() -> Result<OggOpus, String> {
        let err = |e: opus::Error| format!("Opus encoder: {e}");
        let mut encoder = opus::Encoder::new(
            OPUS_INPUT_RATE,
            opus::Channels::Mono,
            opus::Application::Audio,
        )
        .map_err(err)?;
        encoder
            .set_bitrate(opus::Bitrate::Bits(OPUS_BITS_PER_SECOND))
            .map_err(err)?;
        encoder.set_complexity(OPUS_COMPLEXITY).map_err(err)?;
        let lookahead = encoder.get_lookahead().map_err(err)?;
        let pre_skip = u16::try_from(lookahead * (48_000 / OPUS_INPUT_RATE as i32))
            .map_err(|_| format!("Opus look-ahead of {lookahead} samples"))?;
        Ok(OggOpus {
            encoder,
            pages: ogg::writing::PacketWriter::new(Vec::new()),
            pending: Vec::new(),
            fed: 0,
            frames: 0,
            pre_skip,
            packet: vec![0; 4000],
            ended: false,
        })
    }

    fn written(&mut self) -> Vec<u8> {
        std::mem::take(self.pages.inner_mut())
    }

    fn write(
        &mut self,
        packet: Vec<u8>,
        end: ogg::writing::PacketWriteEndInfo,
        granule: u64,
    ) -> Result<(), String> {
        self.pages
            .write_packet(packet, OGG_SERIAL, end, granule)
            .map_err(|e| format!("Ogg page: {e}"))
    }

    /// `OpusHead` (version 1, mono, pre-skip, the input rate, no gain, mapping family 0) and
    /// `OpusTags` (the vendor string, no comments), each on its own page.
    fn headers(&mut self) -> Result<Vec<u8>, String> {
        use ogg::writing::PacketWriteEndInfo::EndPage;
        let mut head = b"OpusHead".to_vec();
        head.extend_from_slice(&[1, 1]);
        head.extend_from_slice(&self.pre_skip.to_le_bytes());
        head.extend_from_slice(&OPUS_INPUT_RATE.to_le_bytes());
        head.extend_from_slice(&0i16.to_le_bytes());
        head.push(0);
        self.write(head, EndPage, 0)?;
        let vendor = format!("gantry, {}", opus::version());
        let mut tags = b"OpusTags".to_vec();
        tags.extend_from_slice(&(vendor.len() as u32).to_le_bytes());
        tags.extend_from_slice(vendor.as_bytes());
        tags.extend_from_slice(&0u32.to_le_bytes());
        self.write(tags, EndPage, 0)?;
        Ok(self.written())
    }

    /// Encode the whole frames of `pending`; the last packet written ends `end`.
    fn frames(
        &mut self,
        end: ogg::writing::PacketWriteEndInfo,
        last_granule: Option<u64>,
    ) -> Result<(), String> {
        use ogg::writing::PacketWriteEndInfo::NormalPacket;
        let whole = self.pending.len() / OPUS_FRAME;
        for i in 0..whole {
            let frame = &self.pending[i * OPUS_FRAME..(i + 1) * OPUS_FRAME];
            let n = self
                .encoder
                .encode_float(frame, &mut self.packet)
                .map_err(|e| format!("Opus encoding: {e}"))?;
            self.frames += 1;
            let packet = self.packet[..n].to_vec();
            let granule = self.frames * 960;
            if i + 1 == whole {
                self.write(packet, end, last_granule.unwrap_or(granule))?;
            } else {
                self.write(packet, NormalPacket, granule)?;
            }
        }
        self.pending.drain(..whole * OPUS_FRAME);
        Ok(())
    }

    /// A piece at [`OPUS_INPUT_RATE`]: its whole frames on a page of their own.
    fn push(&mut self, samples: &[f32]) -> Result<Vec<u8>, String> {
        if self.ended {
            return Err("Opus stream already ended".into());
        }
        self.fed += samples.len() as u64;
        self.pending.extend_from_slice(samples);
        self.frames(ogg::writing::PacketWriteEndInfo::EndPage, None)?;
        Ok(self.written())
    }

    /// The rest, padded with silence past the look-ahead, on the last page, whose granule
    /// position says where the audio ends.
    fn finish(&mut self) -> Result<Vec<u8>, String> {
        if std::mem::replace(&mut self.ended, true) {
            return Ok(Vec::new());
        }
        let per_48k = u64::from(48_000 / OPUS_INPUT_RATE);
        let end = u64::from(self.pre_skip) + self.fed * per_48k;
        let frames_needed = end.div_ceil(960).max(self.frames + 1);
        let pad = (frames_needed - self.frames) as usize * OPUS_FRAME - self.pending.len();
        self.pending.extend(std::iter::repeat_n(0.0, pad));
        self.frames(ogg::writing::PacketWriteEndInfo::EndStream, Some(end))?;
        Ok(self.written())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::tone;
    use super::super::{decode, resample};
    use super::*;

    /// Every byte a stream of `format` makes of `pieces`.
    fn stream(format: SpeechFormat, rate: u32, pieces: &[&[f32]]) -> Vec<u8> {
        let mut s = Stream::new(format, rate).expect("encoder");
        let mut out = s.start().expect("start");
        for p in pieces {
            out.extend(s.piece(p).expect("piece"));
        }
        out.extend(s.finish().expect("finish"));
        out
    }

    /// The largest |a - b| of two signals, past `skip` samples and before the end.
    fn worst(a: &[f32], b: &[f32], skip: usize) -> f32 {
        let n = a.len().min(b.len()).saturating_sub(skip);
        assert!(
            n > skip,
            "{} and {} samples: too short to compare",
            a.len(),
            b.len()
        );
        (skip..n).map(|i| (a[i] - b[i]).abs()).fold(0.0, f32::max)
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
    fn a_streamed_wav_is_the_whole_file_but_its_length() {
        let t = tone(330.0, 22_050, 0.5);
        let streamed = stream(SpeechFormat::Wav, 22_050, &[&t[..5000], &t[5000..]]);
        let whole = wav(&t, 22_050);
        assert_eq!(streamed[44..], whole[44..]);
        assert_eq!(streamed[..4], whole[..4]);
    }

    #[test]
    fn mp3_in_pieces_decodes_to_the_tone_at_the_voice_rate() {
        let t = tone(440.0, 22_050, 2.0);
        let file = stream(SpeechFormat::Mp3, 22_050, &[&t[..10_000], &t[10_000..]]);
        // MPEG-2 layer III frame sync, no ID3 or Xing frame ahead of the audio.
        assert_eq!((file[0], file[1] & 0xe0), (0xff, 0xe0), "{:x?}", &file[..4]);
        // 64 kbit/s for 2 s of audio, give or take the encoder's delay and last frame.
        assert!(
            (15_000..18_000).contains(&file.len()),
            "{} bytes",
            file.len()
        );
        let back = decode(file, Some("speech.mp3"), 22_050, 60).expect("decoded");
        // LAME's delay and padding add at most two frames of 576 samples.
        let extra = back.samples.len() as i64 - t.len() as i64;
        assert!((0..=1152 + 1105).contains(&extra), "{extra} samples more");
        // Aligned by the encoder delay the decoder leaves in, the tone comes back.
        let best = (0..1700)
            .map(|lag| worst(&back.samples[lag..], &t, 2000))
            .fold(f32::MAX, f32::min);
        assert!(best < 0.05, "{best}");
    }

    #[test]
    fn opus_in_pieces_decodes_to_exactly_the_samples_fed_in() {
        let t = tone(440.0, 22_050, 2.0);
        let cut = [0, 3_000, 3_100, 20_000, t.len()];
        let pieces: Vec<&[f32]> = cut.windows(2).map(|w| &t[w[0]..w[1]]).collect();
        let file = stream(SpeechFormat::Opus, 22_050, &pieces);
        // What the encoder was fed: each piece at 24 kHz.
        let fed: Vec<f32> = pieces
            .iter()
            .flat_map(|p| resample(p, 22_050, 24_000).expect("resampled"))
            .collect();
        // Read back as a player would: packets from the pages, decoded (here at 24 kHz, the
        // rate fed in; positions in the stream are at 48 kHz), the pre-skip dropped, cut at
        // the last granule position.
        let mut reader = ogg::reading::PacketReader::new(std::io::Cursor::new(file));
        let head = reader.read_packet_expected().expect("OpusHead");
        assert_eq!(&head.data[..8], b"OpusHead");
        assert!(head.first_in_stream());
        let pre_skip = u16::from_le_bytes([head.data[10], head.data[11]]) as usize;
        let tags = reader.read_packet_expected().expect("OpusTags");
        assert_eq!(&tags.data[..8], b"OpusTags");
        let mut dec = opus::Decoder::new(24_000, opus::Channels::Mono).expect("decoder");
        let mut out = Vec::new();
        let mut frame = vec![0f32; 2880];
        let mut end = 0;
        let mut pages = std::collections::BTreeSet::new();
        while let Some(p) = reader.read_packet().expect("page") {
            let n = dec
                .decode_float(&p.data, &mut frame, false)
                .expect("packet");
            out.extend_from_slice(&frame[..n]);
            end = p.absgp_page() as usize;
            pages.insert(p.absgp_page());
            if p.last_in_stream() {
                break;
            }
        }
        assert!(pages.len() >= 4, "a page per piece and the last: {pages:?}");
        let played = &out[pre_skip / 2..end / 2];
        assert_eq!(played.len(), fed.len(), "exactly the samples fed in");
        let e = worst(played, &fed, 480);
        assert!(e < 0.05, "{e}");
    }

    #[test]
    fn opus_made_here_is_read_back_by_the_upload_path() {
        let t = tone(440.0, 22_050, 2.0);
        let file = stream(SpeechFormat::Opus, 22_050, &[&t]);
        // symphonia finds the Ogg stream's Opus track, libopus decodes it, the pre-skip goes.
        let back = decode(file, Some("speech.opus"), 16_000, 60).expect("decoded");
        assert!((back.seconds - 2.0).abs() < 0.021, "{} s", back.seconds);
        // A perceptual codec at 48 kbit/s, and two resamplers (22.05 to 24 kHz here, 48 to
        // 16 kHz there): within 15 % of the tone's amplitude at every sample (0.06 measured).
        let e = worst(&back.samples, &tone(440.0, 16_000, 2.0), 1_600);
        assert!(e < 0.075, "{e}");
    }
}
