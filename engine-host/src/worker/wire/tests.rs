//! The wire format's round trips and its refusals of malformed frames (worker protocol tests).

use super::*;
use gantry_engine_abi::Status;

#[test]
fn a_step_survives_the_round_trip() {
    let mut s = Sampling::greedy();
    s.logit_bias = vec![(5, -1.5), (9, 2.0)];
    s.top_logprobs = 3;
    s.want_logprob = true;
    let mask = [0b1010u32, 7];
    let entries = [
        StepEntry {
            seq: 7,
            tokens: &[1, 2, 3],
            sample: None,
            fresh: true,
            allowed: None,
            sample_all: false,
        },
        StepEntry {
            seq: 9,
            tokens: &[42, 43, 44],
            sample: Some(&s),
            fresh: false,
            allowed: Some(&mask),
            sample_all: true,
        },
    ];
    let mut w = Writer::default();
    put_step(&mut w, &entries);
    assert!(w.buf.len() <= step_request_size(&entries));
    let back = get_step(&mut Reader::new(&w.buf)).expect("decodes");
    assert_eq!(back.len(), 2);
    assert_eq!(back[0].seq, 7);
    assert_eq!(back[0].tokens, [1, 2, 3]);
    assert!(back[0].fresh && back[0].sample.is_none() && back[0].allowed.is_none());
    assert!(!back[0].sample_all && back[1].sample_all);
    assert_eq!(back[1].sample.as_ref(), Some(&s));
    assert_eq!(back[1].allowed.as_deref(), Some(&mask[..]));

    // The verifying entry takes one result per token (ABI 1.5 `GANTRY_STEP_SAMPLE_ALL`).
    let token = |t: i32| {
        Some(SampledToken {
            token: t,
            logprob: -0.25,
            top: vec![(t, -0.25), (12, -2.0)],
        })
    };
    let results = vec![None, token(11), token(43), token(7)];
    let mut w = Writer::default();
    put_step_results(&mut w, &results);
    assert!(w.buf.len() <= step_reply_size(&entries));
    assert_eq!(
        get_step_results(&mut Reader::new(&w.buf)).expect("decodes"),
        results
    );
}

#[test]
fn a_truncated_message_is_an_error_not_a_panic() {
    let mut w = Writer::default();
    w.i32s(&[1, 2, 3, 4]);
    for cut in 0..w.buf.len() {
        assert!(Reader::new(&w.buf[..cut]).i32s().is_err(), "cut at {cut}");
    }
    // A count far beyond what follows is refused before any allocation.
    let mut w = Writer::default();
    w.u32(u32::MAX);
    assert!(get_step(&mut Reader::new(&w.buf)).is_err());
}

#[test]
fn infos_survive_the_round_trip() {
    let info = ModelInfo {
        architecture: "gemma3".into(),
        vocab_size: 262_144,
        bos_token: Some(2),
        eos_token: None,
        eog_tokens: vec![1, 106],
        chat_template: Some("{{ messages }}".into()),
        bytes_used: 1 << 30,
        add_bos: true,
        recurrent_state_bytes: 3 << 20,
        audio_sample_rate: 16_000,
        audio_max_samples: 480_000,
        voices: vec!["joe".into(), "amy".into()],
        ..ModelInfo::default()
    };
    let mut w = Writer::default();
    put_model_info(&mut w, &info);
    assert_eq!(get_model_info(&mut Reader::new(&w.buf)).expect("ok"), info);

    let desc = ModelDescriptor {
        model_id: "m".into(),
        model_dir: "/models".into(),
        primary_file: "/models/m.gguf".into(),
        format: Format::Gguf,
        quantization: Some("Q4_K_M".into()),
        mmproj: None,
        context_length: 512,
        max_sequences: 4,
        device_ids: vec![0, 1],
        n_threads: 3,
    };
    let mut w = Writer::default();
    put_descriptor(&mut w, &desc);
    assert_eq!(get_descriptor(&mut Reader::new(&w.buf)).expect("ok"), desc);

    let e = EngineError::new(Status::OomRam, "too big");
    assert_eq!(reply(&error_reply(&e)).err(), Some(e));
}
