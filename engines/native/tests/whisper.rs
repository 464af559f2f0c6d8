//! Speech recognition in the native engine against Hugging Face transformers (load, ABI 1.9
//! `seq_set_input` and the decoder's steps, through the node's engine host as `gantry-node`
//! runs the plugin). `testkit/python/hf_whisper.py` (run by `scripts/setup.sh`) writes a tiny
//! random `WhisperForConditionalGeneration` and, for two signals, transformers' log-mel
//! features at a few frames, its log-probabilities after each token of the decoder prompt, its
//! greedy continuation and the log-probabilities along it. Here:
//! - the engine's front end gives the same features;
//! - each signal, alone, gives the same log-probabilities (the engine's 20 most likely tokens
//!   at every position) and the same greedy tokens;
//! - both signals decoded in one batch give what each gives alone;
//! - the inputs the model cannot take are refused with the reason;
//! - Whisper tiny.en's released weights transcribe real recordings as transformers does.

use gantry_engine_abi::{Input, Sampling, Status, StepEntry};
use gantry_node::engine_host::ModelExec;
use serde_json::Value;

mod common;
use common::*;

const RATE: u32 = 16_000;

struct Case {
    audio: Vec<f32>,
    features: Vec<(usize, Vec<f32>)>,
    prompt_logprobs: Vec<Vec<f32>>,
    greedy: Vec<i32>,
    greedy_logprobs: Vec<Vec<f32>>,
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array().expect("rows").iter().map(floats).collect()
}

fn reference() -> (std::path::PathBuf, Vec<i32>, Vec<Case>) {
    let dir = env_path("GANTRY_HF_REFERENCE").join("whisper-float32");
    let r: Value = serde_json::from_slice(
        &std::fs::read(dir.join("reference.json")).expect("reference.json: run scripts/setup.sh"),
    )
    .expect("json");
    let prompt = r["prompt"]
        .as_array()
        .expect("prompt")
        .iter()
        .map(|t| t.as_i64().expect("a token") as i32)
        .collect();
    let cases = r["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            audio: floats(&c["audio"]),
            features: c["features"]
                .as_object()
                .expect("features")
                .iter()
                .map(|(f, v)| (f.parse().expect("a frame"), floats(v)))
                .collect(),
            prompt_logprobs: rows(&c["prompt_logprobs"]),
            greedy: c["greedy"]
                .as_array()
                .expect("greedy")
                .iter()
                .map(|t| t.as_i64().expect("a token") as i32)
                .collect(),
            greedy_logprobs: rows(&c["greedy_logprobs"]),
        })
        .collect();
    (dir, prompt, cases)
}

fn sampling() -> Sampling {
    Sampling {
        top_logprobs: 20,
        want_logprob: true,
        ..Sampling::greedy()
    }
}

/// The largest gap between the engine's top log-probabilities and the reference row's.
fn gap(top: &[(i32, f32)], want: &[f32]) -> f32 {
    top.iter()
        .map(|(t, lp)| (lp - want[*t as usize]).abs())
        .fold(0.0, f32::max)
}

fn entry<'a>(seq: u64, tokens: &'a [i32], s: &'a Sampling, all: bool) -> StepEntry<'a> {
    StepEntry {
        seq,
        tokens,
        sample: Some(s),
        fresh: true,
        allowed: None,
        sample_all: all,
    }
}

/// Open a sequence with `audio` as its input.
fn open(exec: &mut ModelExec, audio: &[f32]) -> u64 {
    open_aligned(exec, audio, false)
}

/// Open a sequence with `audio` as its input, asking for token times or not.
fn open_aligned(exec: &mut ModelExec, audio: &[f32], align: bool) -> u64 {
    let seq = exec.seq_open().expect("open");
    exec.seq_set_input(
        seq,
        &Input::Audio {
            samples: audio,
            sample_rate: RATE,
            align,
        },
    )
    .expect("seq_set_input");
    seq
}

#[test]
fn whisper_matches_transformers_alone_and_in_a_batch() {
    let (dir, prompt, cases) = reference();

    // The front end on its own.
    let mel = gantry_engine_native::whisper::mel::LogMel::new(80);
    let mut worst_mel = 0.0f32;
    for c in &cases {
        let f = mel.features(&c.audio);
        for (frame, want) in &c.features {
            for (m, w) in want.iter().enumerate() {
                let got = f[m * gantry_engine_native::whisper::mel::FRAMES + frame];
                worst_mel = worst_mel.max((got - w).abs());
            }
        }
    }
    println!("whisper: max |log-mel engine - transformers| {worst_mel:.2e}");
    assert!(worst_mel < 1e-4, "{worst_mel:.2e}");

    let plugin = plugin("native", 4, 64);
    let (shared, mut exec) = plugin
        .load_model(&st_desc("whisper", &dir))
        .expect("load the Whisper checkpoint");
    let info = shared.info();
    assert_eq!(info.architecture, "WhisperForConditionalGeneration");
    assert!(info.supports_transcription() && !info.supports_completion());
    assert_eq!(
        (info.audio_sample_rate, info.audio_max_samples),
        (RATE, 480_000)
    );
    let s = sampling();

    // Each signal alone: the prompt in one step sampled after every token, then the
    // reference's continuation one token per step.
    let mut worst = 0.0f32;
    let mut alone = Vec::new();
    for c in &cases {
        let seq = open(&mut exec, &c.audio);
        let r = exec
            .step(&[entry(seq, &prompt, &s, true)])
            .expect("the prompt");
        for (got, want) in r.iter().zip(&c.prompt_logprobs) {
            worst = worst.max(gap(&got.as_ref().expect("a sample").top, want));
        }
        let mut greedy = vec![r.last().expect("a row").as_ref().expect("a sample").token];
        let mut tops = Vec::new();
        for i in 0..c.greedy.len() {
            let fed = [c.greedy[i]];
            let r = exec.step(&[entry(seq, &fed, &s, false)]).expect("decode");
            let t = r[0].as_ref().expect("a sample");
            if i + 1 < c.greedy.len() {
                worst = worst.max(gap(&t.top, &c.greedy_logprobs[i + 1]));
                greedy.push(t.token);
            }
            tops.push(t.top.clone());
        }
        assert_eq!(greedy, c.greedy, "greedy tokens");
        exec.seq_release(seq);
        alone.push(tops);
    }
    println!("whisper: max |log-prob engine - transformers| {worst:.2e}");
    assert!(worst < 1e-3, "{worst:.2e}");

    // Both in one batch: the prompts in one step, then the continuations together.
    let seqs: Vec<u64> = cases.iter().map(|c| open(&mut exec, &c.audio)).collect();
    let entries: Vec<StepEntry<'_>> = seqs.iter().map(|&q| entry(q, &prompt, &s, false)).collect();
    exec.step(&entries).expect("both prompts");
    for (i, _) in cases[0].greedy.iter().enumerate() {
        let fed: Vec<[i32; 1]> = cases.iter().map(|c| [c.greedy[i]]).collect();
        let entries: Vec<StepEntry<'_>> = seqs
            .iter()
            .zip(&fed)
            .map(|(&q, t)| entry(q, t, &s, false))
            .collect();
        let r = exec.step(&entries).expect("both decode");
        for (k, got) in r.iter().enumerate() {
            assert_eq!(
                got.as_ref().expect("a sample").top,
                alone[k][i],
                "signal {k} at step {i}: batched as alone"
            );
        }
    }
}

#[test]
fn whisper_refuses_what_it_cannot_take_and_keeps_serving() {
    let (dir, prompt, cases) = reference();
    let plugin = plugin("native", 2, 64);
    let (_shared, mut exec) = plugin
        .load_model(&st_desc("whisper", &dir))
        .expect("load the Whisper checkpoint");
    let seq = exec.seq_open().expect("open");
    let s = sampling();
    // No audio yet: nothing to decode.
    let e = exec
        .step(&[entry(seq, &prompt, &s, false)])
        .expect_err("no audio");
    assert_eq!(e.status, Status::Unsupported);
    assert!(e.message.contains("seq_set_input"), "{}", e.message);
    fn audio(samples: &[f32], sample_rate: u32) -> Input<'_> {
        Input::Audio {
            samples,
            sample_rate,
            align: false,
        }
    }
    for (input, words) in [
        (audio(&cases[0].audio, 44_100), "44100 Hz"),
        (audio(&[], RATE), "0 samples"),
        (audio(&vec![0.0; 480_001], RATE), "480001 samples"),
        (
            Input::Image {
                rgb: &[0; 12],
                width: 2,
                height: 2,
            },
            "not an image input",
        ),
        (
            // The random checkpoint's generation_config.json names no alignment heads.
            Input::Audio {
                samples: &cases[0].audio,
                sample_rate: RATE,
                align: true,
            },
            "alignment heads",
        ),
    ] {
        let e = exec.seq_set_input(seq, &input).expect_err(words);
        assert_eq!(e.status, Status::Unsupported, "{words}");
        assert!(e.message.contains(words), "{}", e.message);
    }
    // The sequence takes its audio afterwards and decodes.
    exec.seq_set_input(seq, &audio(&cases[0].audio, RATE))
        .expect("the audio");
    let r = exec
        .step(&[entry(seq, &prompt, &s, false)])
        .expect("the prompt");
    assert_eq!(r[0].as_ref().expect("a sample").token, cases[0].greedy[0]);
}

/// The words of a transcript, for a word error rate: lower case, punctuation and hyphens as
/// spaces, "Mr." as the "mister" the LibriVox transcripts spell out.
fn words(text: &str) -> Vec<String> {
    text.to_lowercase()
        .replace("mr.", "mister")
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '\'' {
                c
            } else {
                ' '
            }
        })
        .collect::<String>()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Word-level edit distance (substitutions, insertions, deletions).
fn word_errors(got: &[String], want: &[String]) -> usize {
    let mut row: Vec<usize> = (0..=want.len()).collect();
    for (i, g) in got.iter().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, w) in want.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(g != w)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[want.len()]
}

/// Whisper tiny.en's released weights (converted from CTranslate2 by `scripts/setup.sh`) on
/// real recordings (JFK's "ask not", five LibriVox clips), decoded by the engine with the
/// checkpoint's own rules, against transformers' `generate` on the same files
/// (`whisper-tiny-en.json`, written by `testkit/python/hf_whisper.py real`):
/// - without timestamps and with them, the same tokens, and at every step the 20 likeliest
///   tokens' log-probabilities after the rules within 2e-3 of transformers';
/// - every recording in one batch gives what each gives alone;
/// - the word error rate against the human transcripts, over all six, at most 10 %.
#[test]
fn whisper_tiny_en_transcribes_real_speech_as_transformers_does() {
    let dir = env_path("GANTRY_WHISPER_DIR");
    let speech = env_path("GANTRY_SPEECH_DIR");
    let r: Value = serde_json::from_slice(
        &std::fs::read(env_path("GANTRY_HF_REFERENCE").join("whisper-tiny-en.json"))
            .expect("whisper-tiny-en.json: run scripts/setup.sh"),
    )
    .expect("json");
    let transcripts: Value = serde_json::from_slice(
        &std::fs::read(speech.join("transcripts.json")).expect("transcripts.json"),
    )
    .expect("json");
    let plugin = plugin("native", 8, 448);
    let (shared, mut exec) = plugin
        .load_model(&st_desc("whisper-tiny.en", &dir))
        .expect("load Whisper tiny.en");
    let eos = shared.info().eos_token.expect("an end of text");
    let tokens = |v: &Value| -> Vec<i32> {
        v.as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_i64().expect("a token") as i32)
            .collect()
    };
    let s = sampling();
    let (mut worst, mut errors, mut total) = (0.0f32, 0, 0);
    let mut audios = Vec::new();
    for c in r["cases"].as_array().expect("cases") {
        let file = c["file"].as_str().expect("file");
        let bytes = std::fs::read(speech.join(file)).expect("the recording");
        let audio = gantry_node::audio::decode(bytes, Some(file), RATE, 60)
            .expect("decode")
            .samples;
        for mode in ["plain", "timestamps"] {
            let want = &c[mode];
            let prompt = tokens(&want["prompt"]);
            let want_tokens = tokens(&want["tokens"]);
            let seq = open(&mut exec, &audio);
            let mut fed = prompt.clone();
            let mut got = Vec::new();
            for (i, top) in want["top"].as_array().expect("top").iter().enumerate() {
                let r = exec.step(&[entry(seq, &fed, &s, false)]).expect("decode");
                let t = r[0].as_ref().expect("a sample");
                for pair in top.as_array().expect("pairs") {
                    let id = pair[0].as_i64().expect("a token id") as i32;
                    let lp = pair[1].as_f64().expect("a log-probability");
                    if lp < -15.0 {
                        continue;
                    }
                    let mine = t.top.iter().find(|(k, _)| *k == id).map(|(_, v)| *v);
                    let mine = mine.unwrap_or_else(|| {
                        panic!("{file} {mode} step {i}: token {id} ({lp:.3}) not in the engine's top 20")
                    });
                    worst = worst.max((mine - lp as f32).abs());
                }
                got.push(t.token);
                fed = vec![t.token];
                if i + 1 == want_tokens.len() {
                    break;
                }
            }
            assert_eq!(
                got, want_tokens,
                "{file} {mode}: the tokens transformers samples"
            );
            // After transformers' last token the engine ends the text.
            let r = exec.step(&[entry(seq, &fed, &s, false)]).expect("decode");
            assert_eq!(
                r[0].as_ref().expect("a sample").token,
                eos,
                "{file} {mode}: the end"
            );
            exec.seq_release(seq);
            if mode == "plain" {
                let text = String::from_utf8(shared.detokenize(&got, false).expect("text"))
                    .expect("utf-8");
                assert_eq!(text.trim(), want["text"].as_str().expect("text"), "{file}");
                let human = words(transcripts[file].as_str().expect("a transcript"));
                let e = word_errors(&words(&text), &human);
                println!(
                    "whisper-tiny.en {file}: {text:?} ({e} word errors of {})",
                    human.len()
                );
                errors += e;
                total += human.len();
            }
        }
        audios.push((
            audio,
            tokens(&c["plain"]["prompt"]),
            tokens(&c["plain"]["tokens"]),
        ));
    }
    println!(
        "whisper-tiny.en: max |log-prob engine - transformers| {worst:.2e}; word error rate {errors}/{total}"
    );
    assert!(worst < 2e-3, "{worst:.2e}");
    assert!(
        errors * 10 <= total,
        "word error rate {errors}/{total} over 10 %"
    );

    // All six in one batch, fed their reference tokens: each samples what it sampled alone.
    let seqs: Vec<u64> = audios.iter().map(|(a, _, _)| open(&mut exec, a)).collect();
    let longest = audios.iter().map(|(_, _, t)| t.len()).max().unwrap_or(0);
    let mut fed: Vec<Vec<i32>> = audios.iter().map(|(_, p, _)| p.clone()).collect();
    for i in 0..longest {
        let live: Vec<usize> = (0..seqs.len()).filter(|&k| i < audios[k].2.len()).collect();
        let entries: Vec<StepEntry<'_>> = live
            .iter()
            .map(|&k| entry(seqs[k], &fed[k], &s, false))
            .collect();
        let r = exec.step(&entries).expect("batched decode");
        for (&k, got) in live.iter().zip(&r) {
            let t = got.as_ref().expect("a sample").token;
            assert_eq!(
                t, audios[k].2[i],
                "recording {k} at step {i}: batched as alone"
            );
            fed[k] = vec![t];
        }
    }
    for s in seqs {
        exec.seq_release(s);
    }

    // Token times (ABI 1.11) of the first recording's plain decode: one per sampled token,
    // from the prompt's last token on, in order, within the audio; a sequence whose input did
    // not ask for them is refused.
    let (audio, prompt, want) = &audios[0];
    let seq = open_aligned(&mut exec, audio, true);
    let mut fed = prompt.clone();
    for &t in want {
        exec.step(&[entry(seq, &fed, &s, false)]).expect("decode");
        fed = vec![t];
    }
    let times = exec
        .seq_token_times(seq, prompt.len() - 1)
        .expect("token times");
    let secs = audio.len() as f32 / RATE as f32;
    assert_eq!(times.len(), want.len(), "{times:?}");
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]) && times.iter().all(|&t| (0.0..=secs).contains(&t)),
        "{times:?} over {secs} s"
    );
    assert!(
        times[want.len() - 1] > secs / 2.0,
        "the text ends in the audio's second half: {times:?}"
    );
    // The no-speech probability (ABI 1.11 `seq_token_prob`): `<|nocaptions|>` right after
    // `<|startoftranscript|>`, as transformers' raw logits give it.
    let no_speech = shared
        .tokenize("<|nocaptions|>", false, true)
        .expect("token")[0];
    let p = exec
        .seq_token_prob(seq, 1, no_speech)
        .expect("the probability");
    let want = r["cases"][0]["no_speech_prob"]
        .as_f64()
        .expect("no_speech_prob") as f32;
    assert!((p - want).abs() < 1e-5, "{p} against transformers' {want}");
    for (n, token) in [(0, no_speech), (9999, no_speech), (1, -1)] {
        let e = exec
            .seq_token_prob(seq, n, token)
            .expect_err("out of range");
        assert_eq!(e.status, Status::Unsupported, "{}", e.message);
    }
    exec.seq_release(seq);
    let plain = open(&mut exec, audio);
    let e = exec.seq_token_times(plain, 0).expect_err("not asked for");
    assert_eq!(e.status, Status::Unsupported, "{}", e.message);
}
