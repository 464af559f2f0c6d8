//! ABI contract check: the `repr(C)` mirrors must match `gantry_engine.h` byte for byte.
//!
//! The test writes a C program that prints `sizeof`/`offsetof` for every
//! struct and field, compiles it against the header with the system C
//! compiler, and compares each line with what Rust computes.

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::path::Path;
use std::process::Command;

use gantry_engine_abi::ffi::*;

macro_rules! layout {
    ($rows:ident, $ty:ident { $($field:ident),* $(,)? }) => {{
        $rows.push((format!("sizeof {}", stringify!($ty)), size_of::<$ty>()));
        $(
            $rows.push((
                format!("offsetof {}.{}", stringify!($ty), stringify!($field)),
                offset_of!($ty, $field),
            ));
        )*
    }};
}

fn rust_layout() -> Vec<(String, usize)> {
    let mut rows = Vec::new();
    layout!(rows, gantry_error_t { message });
    layout!(
        rows,
        gantry_engine_info_t {
            struct_size,
            engine_id,
            engine_version,
            backend,
            description,
            capabilities,
            build_info
        }
    );
    layout!(
        rows,
        gantry_host_api_t {
            struct_size,
            ctx,
            log
        }
    );
    layout!(
        rows,
        gantry_engine_config_t {
            struct_size,
            backend,
            device_ids,
            n_device_ids,
            vram_limit_bytes,
            n_threads,
            max_batch_size,
            context_length
        }
    );
    layout!(
        rows,
        gantry_model_desc_t {
            struct_size,
            model_id,
            model_dir,
            primary_file,
            format,
            quantization,
            mmproj,
            context_length,
            max_sequences,
            device_ids,
            n_device_ids,
            n_threads
        }
    );
    layout!(
        rows,
        gantry_adapter_desc_t {
            struct_size,
            name,
            path,
            format,
            scale
        }
    );
    layout!(
        rows,
        gantry_model_info_t {
            struct_size,
            architecture,
            vocab_size,
            context_length,
            trained_context_length,
            kv_capacity_tokens,
            max_sequences,
            bos_token,
            eos_token,
            eog_tokens,
            n_eog_tokens,
            bos_text,
            eos_text,
            chat_template,
            bytes_used,
            modalities,
            embedding_dims,
            add_bos,
            recurrent_state_bytes,
            audio_sample_rate,
            audio_max_samples,
            voices
        }
    );
    layout!(
        rows,
        gantry_speech_request_t {
            struct_size,
            text,
            n_text,
            voice,
            speed
        }
    );
    layout!(
        rows,
        gantry_input_t {
            struct_size,
            kind,
            data,
            n,
            sample_rate,
            width,
            height,
            flags
        }
    );
    layout!(rows, gantry_logit_bias_t { token, bias });
    layout!(
        rows,
        gantry_sampling_t {
            struct_size,
            temperature,
            top_p,
            top_k,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            penalty_last_n,
            seed,
            logit_bias,
            n_logit_bias,
            top_logprobs,
            want_logprob,
            allowed_tokens,
            n_allowed_words
        }
    );
    layout!(
        rows,
        gantry_step_entry_t {
            seq,
            tokens,
            n_tokens,
            flags,
            sampling
        }
    );
    layout!(rows, gantry_token_logprob_t { token, logprob });
    layout!(
        rows,
        gantry_step_result_t {
            token,
            logprob,
            n_top,
            top
        }
    );
    layout!(
        rows,
        gantry_engine_vtable_t {
            struct_size,
            info,
            create,
            destroy,
            load_model,
            model_info,
            tokenize,
            detokenize,
            seq_open,
            seq_release,
            step,
            embed,
            unload_model,
            seq_cached_tokens,
            seq_fork,
            seq_truncate,
            adapter_load,
            adapter_unload,
            seq_set_adapter,
            embed_batch,
            seq_set_input,
            speech_open,
            speech_next,
            speech_close,
            seq_token_times,
            seq_token_prob,
            model_counters
        }
    );
    layout!(rows, gantry_counter_t { name, value });
    layout!(
        rows,
        gantry_engine_entry_t {
            abi_major,
            abi_minor,
            struct_size,
            vtable
        }
    );
    rows
}

fn c_program(rows: &[(String, usize)]) -> String {
    let mut src = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"gantry_engine.h\"\nint main(void) {\n",
    );
    for (key, _) in rows {
        let expr = if let Some(ty) = key.strip_prefix("sizeof ") {
            format!("sizeof({ty})")
        } else {
            let (ty, field) = key["offsetof ".len()..].split_once('.').expect("row key");
            format!("offsetof({ty}, {field})")
        };
        src.push_str(&format!("  printf(\"{key} %zu\\n\", (size_t)({expr}));\n"));
    }
    src.push_str("  return 0;\n}\n");
    src
}

fn compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

#[test]
fn header_and_rust_mirrors_agree_on_every_size_and_offset() {
    let rows = rust_layout();
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("layout.c");
    let bin = dir.path().join("layout");
    std::fs::write(&src, c_program(&rows)).expect("write C source");
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let status = Command::new(compiler())
        .args(["-std=c99", "-Wall", "-Werror", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .status()
        .expect("a C compiler (cc) must be installed to check the ABI");
    assert!(status.success(), "the header does not compile as C99");
    let out = Command::new(&bin).output().expect("run layout probe");
    let c: BTreeMap<String, usize> = String::from_utf8(out.stdout)
        .expect("utf8")
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').expect("row");
            (k.to_string(), v.parse().expect("number"))
        })
        .collect();
    let mut mismatches = Vec::new();
    for (key, rust) in &rows {
        match c.get(key) {
            Some(c_val) if c_val == rust => {}
            other => mismatches.push(format!("{key}: C {other:?}, Rust {rust}")),
        }
    }
    assert!(
        mismatches.is_empty(),
        "ABI layout mismatches:\n{}",
        mismatches.join("\n")
    );
    assert_eq!(c.len(), rows.len());
}

#[test]
fn header_constants_match_rust_constants() {
    let header = gantry_engine_abi::HEADER;
    let define = |name: &str| -> String {
        header
            .lines()
            .find_map(|l| {
                let rest = l.strip_prefix("#define ")?;
                let (n, v) = rest.split_once(' ')?;
                let value = v.split("/*").next().unwrap_or(v).trim();
                (n == name).then(|| value.trim_end_matches('u').to_string())
            })
            .unwrap_or_else(|| panic!("{name} missing from the header"))
    };
    assert_eq!(define("GANTRY_ABI_MAJOR"), GANTRY_ABI_MAJOR.to_string());
    assert_eq!(define("GANTRY_ABI_MINOR"), GANTRY_ABI_MINOR.to_string());
    assert_eq!(
        define("GANTRY_ERROR_MESSAGE_MAX"),
        GANTRY_ERROR_MESSAGE_MAX.to_string()
    );
    assert_eq!(
        define("GANTRY_MAX_TOP_LOGPROBS"),
        GANTRY_MAX_TOP_LOGPROBS.to_string()
    );
    assert_eq!(
        define("GANTRY_ENGINE_ENTRY_SYMBOL"),
        "\"gantry_engine_entry\""
    );
    assert_eq!(define("GANTRY_STEP_SAMPLE"), GANTRY_STEP_SAMPLE.to_string());
    assert_eq!(define("GANTRY_STEP_FRESH"), GANTRY_STEP_FRESH.to_string());
    assert_eq!(
        define("GANTRY_STEP_SAMPLE_ALL"),
        GANTRY_STEP_SAMPLE_ALL.to_string()
    );
    assert_eq!(
        define("GANTRY_CAP_SPECULATE"),
        GANTRY_CAP_SPECULATE.to_string()
    );
    assert_eq!(
        define("GANTRY_CAP_TOKEN_MASK"),
        GANTRY_CAP_TOKEN_MASK.to_string()
    );
    for (name, value) in [
        ("GANTRY_MODALITY_COMPLETION", GANTRY_MODALITY_COMPLETION),
        ("GANTRY_MODALITY_EMBEDDING", GANTRY_MODALITY_EMBEDDING),
        (
            "GANTRY_MODALITY_TRANSCRIPTION",
            GANTRY_MODALITY_TRANSCRIPTION,
        ),
        ("GANTRY_MODALITY_SPEECH", GANTRY_MODALITY_SPEECH),
        ("GANTRY_MODALITY_VISION", GANTRY_MODALITY_VISION),
        ("GANTRY_MODALITY_IMAGE", GANTRY_MODALITY_IMAGE),
        ("GANTRY_INPUT_AUDIO", GANTRY_INPUT_AUDIO),
        ("GANTRY_INPUT_IMAGE", GANTRY_INPUT_IMAGE),
    ] {
        assert_eq!(define(name), value.to_string(), "{name}");
    }
    let codes = [
        ("GANTRY_OK", GANTRY_OK),
        ("GANTRY_OOM_VRAM", GANTRY_OOM_VRAM),
        ("GANTRY_OOM_RAM", GANTRY_OOM_RAM),
        ("GANTRY_MODEL_CORRUPT", GANTRY_MODEL_CORRUPT),
        ("GANTRY_TIMEOUT", GANTRY_TIMEOUT),
        ("GANTRY_CANCELLED", GANTRY_CANCELLED),
        ("GANTRY_UNSUPPORTED", GANTRY_UNSUPPORTED),
        ("GANTRY_INTERNAL", GANTRY_INTERNAL),
        ("GANTRY_ABI_MISMATCH", GANTRY_ABI_MISMATCH),
        ("GANTRY_LOAD_FAILED", GANTRY_LOAD_FAILED),
    ];
    for (name, value) in codes {
        assert_eq!(define(name), value.to_string(), "{name}");
    }
    // Exactly the ten codes of the specification: the values 0..=9, each once.
    let mut values: Vec<i32> = codes.iter().map(|(_, v)| *v).collect();
    values.sort_unstable();
    assert_eq!(values, (0..10).collect::<Vec<_>>());
    assert_eq!(gantry_engine_abi::Status::ALL.len(), 10);
}
