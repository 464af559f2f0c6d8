//! `config.json` parser tests (model metadata, before engine selection): real configs of common
//! model families as fixtures, the context-length aliases, and hostile input refused with the
//! field named.

use std::path::{Path, PathBuf};

use gantry_formats::hf_config::{self, HfConfigError, MAX_CONFIG_BYTES};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf_config")
        .join(name)
}

fn parse_str(s: &str) -> Result<hf_config::HfConfig, HfConfigError> {
    hf_config::parse(s.as_bytes())
}

#[test]
fn real_configs_give_model_type_class_and_context_length() {
    // (file, model_type, class, context length, the key it came from)
    let cases = [
        (
            "llama-3.1-8b-instruct.json",
            "llama",
            "LlamaForCausalLM",
            Some((131072, "max_position_embeddings")),
        ),
        (
            "qwen2.5-0.5b-instruct.json",
            "qwen2",
            "Qwen2ForCausalLM",
            Some((32768, "max_position_embeddings")),
        ),
        (
            "gemma-3-270m.json",
            "gemma3_text",
            "Gemma3ForCausalLM",
            Some((32768, "max_position_embeddings")),
        ),
        (
            "mistral-7b-instruct-v0.3.json",
            "mistral",
            "MistralForCausalLM",
            Some((32768, "max_position_embeddings")),
        ),
        (
            "phi-3-mini-4k-instruct.json",
            "phi3",
            "Phi3ForCausalLM",
            Some((4096, "max_position_embeddings")),
        ),
        (
            "gpt2.json",
            "gpt2",
            "GPT2LMHeadModel",
            Some((1024, "n_positions")),
        ),
        (
            "chatglm3-6b.json",
            "chatglm",
            "ChatGLMModel",
            Some((8192, "seq_length")),
        ),
        // The multimodal Gemma 3 states no length at all (transformers' default applies).
        (
            "gemma-3-4b-it.json",
            "gemma3",
            "Gemma3ForConditionalGeneration",
            None,
        ),
    ];
    for (file, model_type, class, ctx) in cases {
        let c = hf_config::read(&fixture(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(c.model_type, model_type, "{file}");
        assert_eq!(c.architectures, vec![class.to_string()], "{file}");
        assert_eq!(
            c.context_length.map(|c| (c.tokens, c.key)),
            ctx.map(|(n, k)| (n, k.to_string())),
            "{file}"
        );
        // GPT-2's config predates `torch_dtype`.
        assert_eq!(c.torch_dtype.is_some(), file != "gpt2.json", "{file}");
    }
}

#[test]
fn the_text_config_supplies_a_missing_context_length_and_the_top_level_wins() {
    let c = parse_str(
        r#"{"model_type":"llava","text_config":{"model_type":"llama","max_position_embeddings":4096}}"#,
    )
    .expect("valid");
    let ctx = c.context_length.expect("nested length");
    assert_eq!(
        (ctx.tokens, ctx.key.as_str()),
        (4096, "text_config.max_position_embeddings")
    );
    let c = parse_str(
        r#"{"model_type":"x","max_seq_len":2048,"text_config":{"max_position_embeddings":4096}}"#,
    )
    .expect("valid");
    assert_eq!(c.context_length.map(|c| c.tokens), Some(2048));
    // A null alias is skipped, not an error.
    let c = parse_str(r#"{"model_type":"x","max_position_embeddings":null,"n_ctx":512}"#)
        .expect("valid");
    assert_eq!(c.context_length.map(|c| c.key), Some("n_ctx".to_string()));
    assert!(
        parse_str(r#"{"model_type":"x"}"#)
            .expect("valid")
            .architectures
            .is_empty()
    );
}

#[test]
fn bad_fields_are_refused_with_the_field_and_the_rule() {
    let cases = [
        (r#"{"architectures":["A"]}"#, "no `model_type`"),
        (
            r#"{"model_type":7}"#,
            "`model_type` must be a string, got a number",
        ),
        (r#"{"model_type":""}"#, "`model_type` must not be empty"),
        (
            r#"{"model_type":"x","architectures":"A"}"#,
            "`architectures` must be an array of strings, got a string",
        ),
        (
            r#"{"model_type":"x","architectures":["A",3]}"#,
            "`architectures[1]` must be a string, got a number",
        ),
        (
            r#"{"model_type":"x","max_position_embeddings":-1}"#,
            "`max_position_embeddings` must be a positive integer, got -1",
        ),
        (
            r#"{"model_type":"x","max_position_embeddings":4096.5}"#,
            "`max_position_embeddings` must be a positive integer, got 4096.5",
        ),
        (
            r#"{"model_type":"x","n_positions":"1024"}"#,
            "`n_positions` must be a positive integer, got \"1024\"",
        ),
        (
            r#"{"model_type":"x","seq_length":0}"#,
            "`seq_length` must be >= 1, got 0",
        ),
        (
            r#"{"model_type":"x","max_position_embeddings":4294967296}"#,
            "`max_position_embeddings` must be <= 4294967295, got 4294967296",
        ),
        (
            r#"{"model_type":"x","text_config":[]}"#,
            "`text_config` must be an object, got an array",
        ),
        (
            r#"{"model_type":"x","text_config":{"max_position_embeddings":true}}"#,
            "`text_config.max_position_embeddings` must be a positive integer, got true",
        ),
        ("[1,2,3]", "must be a JSON object, got an array"),
        (
            "{\"model_type\":",
            "not valid JSON: EOF while parsing a value at line 1 column 14",
        ),
        ("\u{feff}{}", "not valid JSON"),
    ];
    for (input, want) in cases {
        let err = parse_str(input).expect_err(input).to_string();
        assert!(
            err.contains(want),
            "{input}: {err:?} should contain {want:?}"
        );
    }
}

#[test]
fn hostile_input_is_bounded_in_size_depth_and_message_length() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(
        matches!(parse_str(&deep), Err(HfConfigError::Json(m)) if m.contains("recursion limit"))
    );

    let huge = vec![b' '; MAX_CONFIG_BYTES + 1];
    let err = hf_config::parse(&huge).expect_err("too large");
    assert_eq!(err.metric_label(), "config_too_large");
    assert!(
        err.to_string().contains("the limit is 4194304 bytes"),
        "{err}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("config.json");
    std::fs::write(&p, &huge).expect("write");
    assert!(
        matches!(hf_config::read(&p), Err(HfConfigError::TooLarge { len }) if len == huge.len() as u64)
    );
    assert!(matches!(
        hf_config::read(&dir.path().join("none.json")),
        Err(HfConfigError::Io(_))
    ));

    // A long bad value is shown cut short, on a character boundary.
    let long = format!(
        r#"{{"model_type":"x","max_position_embeddings":"{}"}}"#,
        "é".repeat(500)
    );
    let err = parse_str(&long).expect_err("string length").to_string();
    assert!(err.len() < 160 && err.ends_with('…'), "{err}");
    let names = format!(r#"{{"model_type":"{}"}}"#, "a".repeat(300));
    assert!(
        parse_str(&names)
            .expect_err("long name")
            .to_string()
            .contains("<= 256 bytes")
    );
    let many = format!(
        r#"{{"model_type":"x","architectures":[{}"A"]}}"#,
        "\"A\",".repeat(64)
    );
    assert!(
        parse_str(&many)
            .expect_err("many")
            .to_string()
            .contains("<= 64 classes, got 65")
    );
}
