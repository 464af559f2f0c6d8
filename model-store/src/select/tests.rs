//! Tests of artifact selection (`select.rs`): GGUF, safetensors and onnx listings.
use super::*;

#[test]
fn an_onnx_model_is_its_graph_and_its_config() {
    let l = ls(&[
        "en_US-joe-medium.onnx",
        "en_US-joe-medium.onnx.json",
        "MODEL_CARD",
        "samples/x.wav",
    ]);
    let s = select(&l, Format::Onnx, None, &[]).expect("onnx");
    assert_eq!(s.primary, "en_US-joe-medium.onnx");
    let mut names: Vec<_> = s.files.iter().map(|f| f.path.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        ["en_US-joe-medium.onnx", "en_US-joe-medium.onnx.json"]
    );
    let e = select(&ls(&["a.onnx"]), Format::Onnx, None, &[]).expect_err("refused");
    assert!(e.to_string().contains("a.onnx.json"), "{e}");
    let e = select(&ls(&["a.onnx", "b.onnx"]), Format::Onnx, None, &[]).expect_err("refused");
    assert!(e.to_string().contains("a.onnx, b.onnx;"), "{e}");
    let e = select(&ls(&["a.safetensors"]), Format::Onnx, None, &[]).expect_err("refused");
    assert!(e.to_string().contains("no .onnx"), "{e}");
    // A voice collection: one voice per folder, picked with `files`.
    let voices: Vec<String> = (0..8)
        .flat_map(|i| {
            let v = format!("en/v{i}/medium/v{i}.onnx");
            [
                v.clone(),
                format!("{v}.json"),
                format!("en/v{i}/MODEL_CARD"),
            ]
        })
        .collect();
    let listing = ls(&voices.iter().map(String::as_str).collect::<Vec<_>>());
    let e = select(&listing, Format::Onnx, None, &[]).expect_err("several");
    assert!(e.to_string().contains("and 3 more"), "{e}");
    let want = vec![
        "en/v2/medium/v2.onnx".to_string(),
        "en/v2/medium/v2.onnx.json".into(),
    ];
    let s = select(&listing, Format::Onnx, None, &want).expect("picked");
    assert_eq!(s.primary, "en/v2/medium/v2.onnx");
    assert_eq!(s.files.len(), 2);
}

#[test]
fn a_hibari_voice_is_its_graph_registry_and_vocabulary() {
    let l = ls(&[
        "hibari/assets/hibari.onnx",
        "hibari/assets/voices.json",
        "hibari/assets/vocab.json",
        "hibari/assets/normalize.json",
        "hibari/tts.py",
    ]);
    let s = select(&l, Format::Onnx, None, &[]).expect("hibari");
    assert_eq!(s.primary, "hibari/assets/hibari.onnx");
    let mut names: Vec<_> = s.files.iter().map(|f| f.path.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "hibari/assets/hibari.onnx",
            "hibari/assets/vocab.json",
            "hibari/assets/voices.json"
        ]
    );
    // Without its vocabulary it is neither voice; the error names what each needs.
    let e = select(
        &ls(&["v/hibari.onnx", "v/voices.json"]),
        Format::Onnx,
        None,
        &[],
    )
    .expect_err("refused");
    let e = e.to_string();
    assert!(
        e.contains("v/hibari.onnx.json") && e.contains("v/vocab.json"),
        "{e}"
    );
}

fn ls(names: &[&str]) -> Vec<RemoteFile> {
    names
        .iter()
        .map(|n| RemoteFile {
            path: n.to_string(),
            size: 1,
            sha256: None,
        })
        .collect()
}

fn paths(s: &ArtifactSelection) -> Vec<&str> {
    s.files.iter().map(|f| f.path.as_str()).collect()
}

#[test]
fn quantization_is_matched_exactly() {
    let l = ls(&[
        "m-Q4_K_M.gguf",
        "m-Q4_K.gguf",
        "m-Q4_K_S.gguf",
        "m-q4-k-m.gguf",
        "m-Q8_0.gguf",
        "README.md",
    ]);
    let s = select(&l, Format::Gguf, Some("Q4_K_M"), &[]).expect("Q4_K_M");
    assert_eq!(s.primary, "m-Q4_K_M.gguf");
    let s = select(&l, Format::Gguf, Some("Q4_K"), &[]).expect("Q4_K");
    assert_eq!(s.primary, "m-Q4_K.gguf");
    let s = select(&l, Format::Gguf, Some("q4-k-m"), &[]).expect("lowercase is its own name");
    assert_eq!(s.primary, "m-q4-k-m.gguf");
    let e = select(&l, Format::Gguf, Some("q4_k_m"), &[]).expect_err("case counts");
    let msg = e.to_string();
    assert!(msg.contains("no GGUF with quantization `q4_k_m`"), "{msg}");
    assert!(
        msg.contains("m-Q4_K_M.gguf") && msg.contains("m-Q8_0.gguf"),
        "{msg}"
    );
}

#[test]
fn several_candidates_without_a_quantization_are_listed() {
    let l = ls(&["a-Q4_K_M.gguf", "a-Q8_0.gguf"]);
    let msg = select(&l, Format::Gguf, None, &[])
        .expect_err("ambiguous")
        .to_string();
    assert!(
        msg.contains("several GGUF candidates") && msg.contains("a-Q4_K_M.gguf, a-Q8_0.gguf"),
        "{msg}"
    );
    let s = select(&l, Format::Gguf, None, &["a-Q8_0.gguf".into()]).expect("files pick one");
    assert_eq!(s.primary, "a-Q8_0.gguf");
    let e = select(&l, Format::Gguf, None, &["nope.gguf".into()]).expect_err("missing");
    assert!(e.to_string().contains("nope.gguf"));
}

#[test]
fn shards_are_one_artifact_and_must_be_complete() {
    let l = ls(&[
        "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf",
        "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
        "m-Q8_0.gguf",
    ]);
    let s = select(&l, Format::Gguf, Some("Q4_K_M"), &[]).expect("sharded");
    assert_eq!(s.primary, "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf");
    assert_eq!(s.files.len(), 2);
    let e = select(&l, Format::Gguf, None, &[]).expect_err("two artifacts");
    assert!(e.to_string().contains("(2 shards)"), "{e}");
    let broken = ls(&["m-00001-of-00003.gguf", "m-00003-of-00003.gguf"]);
    let e = select(&broken, Format::Gguf, None, &[]).expect_err("missing shard");
    assert!(e.to_string().contains("incomplete"), "{e}");
}

#[test]
fn mmproj_is_attached_and_never_taken_as_the_model() {
    let l = ls(&["m-Q4_K_M.gguf", "mmproj-m-F16.gguf"]);
    let s = select(&l, Format::Gguf, None, &[]).expect("one model");
    assert_eq!(s.primary, "m-Q4_K_M.gguf");
    assert_eq!(s.mmproj.as_deref(), Some("mmproj-m-F16.gguf"));
    assert_eq!(paths(&s), ["m-Q4_K_M.gguf", "mmproj-m-F16.gguf"]);
}

#[test]
fn only_the_registered_format_is_selected() {
    let l = ls(&[
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "m-Q4_K_M.gguf",
        "onnx/model.safetensors",
        "README.md",
    ]);
    let g = select(&l, Format::Gguf, None, &[]).expect("gguf");
    assert_eq!(paths(&g), ["m-Q4_K_M.gguf"]);
    let s = select(&l, Format::Safetensors, None, &[]).expect("safetensors");
    assert_eq!(
        paths(&s),
        ["config.json", "tokenizer.json", "model.safetensors"]
    );
    assert_eq!(s.primary, "model.safetensors");
    let e = select(&l, Format::Safetensors, Some("Q4_K_M"), &[]).expect_err("quant");
    assert!(e.to_string().contains("safetensors"), "{e}");
    let e = select(&ls(&["config.json"]), Format::Gguf, None, &[]).expect_err("none");
    assert!(e.to_string().contains("no .gguf"), "{e}");
}

/// The file the engine opens, for each kind of listing: the one choice
/// local directories and downloads share.
#[test]
fn the_primary_file_of_each_listing() {
    /// A listing, its format and quantization, and the primary file or a part of the error.
    type Case<'a> = (
        &'a [&'a str],
        Format,
        Option<&'a str>,
        Result<&'a str, &'a str>,
    );
    let cases: &[Case<'_>] = &[
        (&["m.gguf"], Format::Gguf, None, Ok("m.gguf")),
        (
            &["m.gguf", "mmproj-m.gguf"],
            Format::Gguf,
            None,
            Ok("m.gguf"),
        ),
        (
            &["README.md", "m.gguf", "m.safetensors"],
            Format::Gguf,
            None,
            Ok("m.gguf"),
        ),
        (
            &["a.gguf", "b.gguf"],
            Format::Gguf,
            None,
            Err("several GGUF candidates"),
        ),
        (
            &["a-Q8_0.gguf", "a-Q4_0.gguf"],
            Format::Gguf,
            Some("Q4_0"),
            Ok("a-Q4_0.gguf"),
        ),
        (
            &["mmproj-m.gguf"],
            Format::Gguf,
            None,
            Err("no .gguf model file"),
        ),
        (
            &["config.json", "model.safetensors"],
            Format::Safetensors,
            None,
            Ok("model.safetensors"),
        ),
        (
            &[
                "config.json",
                "a.safetensors",
                "b.safetensors",
                "model.safetensors.index.json",
            ],
            Format::Safetensors,
            None,
            Ok("model.safetensors.index.json"),
        ),
        (
            &["config.json", "a.safetensors", "b.safetensors"],
            Format::Safetensors,
            None,
            Err("several .safetensors files"),
        ),
        (
            &["model.safetensors"],
            Format::Safetensors,
            None,
            Err("needs config.json"),
        ),
        (
            &["config.json", "m.gguf"],
            Format::Safetensors,
            None,
            Err("no top-level .safetensors"),
        ),
    ];
    for (names, format, quant, want) in cases {
        let got = select(&ls(names), *format, *quant, &[]);
        match (got, want) {
            (Ok(s), Ok(p)) => assert_eq!(s.primary, *p, "{names:?}"),
            (Err(e), Err(msg)) => assert!(e.to_string().contains(msg), "{names:?}: {e}"),
            (got, want) => panic!("{names:?}: got {got:?}, want {want:?}"),
        }
    }
    let files = [
        ("m.gguf", Format::Gguf, true),
        ("m.safetensors", Format::Gguf, false),
        ("model.safetensors", Format::Safetensors, true),
        ("model.safetensors.index.json", Format::Safetensors, true),
        ("m.gguf", Format::Safetensors, false),
    ];
    for (name, format, ok) in files {
        assert_eq!(is_model_file(name, format), ok, "{name}");
    }
}

#[test]
fn sharded_safetensors_use_their_index() {
    let l = ls(&[
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]);
    let s = select(&l, Format::Safetensors, None, &[]).expect("sharded");
    assert_eq!(s.primary, SAFETENSORS_INDEX);
    assert_eq!(s.files.len(), 4);
}
