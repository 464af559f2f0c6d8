//! Engine host tests: discovery, the specification's validation table, ABI refusal and fault isolation,
//! against real shared libraries built in this workspace.

mod common;

use std::path::Path;

use common::*;
use gantry_api::{EngineVerdict, RejectionKind};
use gantry_engine_abi::{
    Backend, EngineConfig, Format, ModelDescriptor, Sampling, Status, StepEntry,
};
use gantry_node::engine_host::{EngineRegistry, Plugin, PluginState};

fn refusal(reg: &EngineRegistry, dir_id: &str) -> String {
    let rec = reg
        .records
        .iter()
        .find(|r| {
            r.manifest_path
                .parent()
                .and_then(Path::parent)
                .and_then(Path::file_name)
                .is_some_and(|n| n == dir_id)
        })
        .unwrap_or_else(|| panic!("no record for {dir_id}"));
    match &rec.state {
        PluginState::Refused { reason, .. } => reason.clone(),
        PluginState::Loaded(_) => panic!("{dir_id} was loaded, expected a refusal"),
    }
}

fn toy_desc(stem: &str) -> ModelDescriptor {
    ModelDescriptor::new(stem, format!("/nonexistent/{stem}.gguf"), Format::Gguf)
}

#[test]
fn each_validation_rule_refuses_with_the_specification_message() {
    let root = tempfile::tempdir().expect("tempdir");
    let faulty = built_lib("gantry_fault_faulty");
    // Directory order decides who loads first: "a_ok" before "b_dup".
    install_plugin(
        root.path(),
        "a_ok",
        "cpu",
        faulty_manifest("faulty"),
        Some(&faulty),
    );
    install_plugin(
        root.path(),
        "b_dup",
        "cpu",
        faulty_manifest("faulty"),
        Some(&faulty),
    );
    let mut m = faulty_manifest("abi2");
    m["abi_version"] = "2".into();
    install_plugin(root.path(), "c_abi", "cpu", m, Some(&faulty));
    let mut m = faulty_manifest("nobin");
    m["binary"] = "libmissing.so".into();
    install_plugin(root.path(), "d_nobin", "cpu", m, None);
    let mut m = faulty_manifest("noarch");
    m["architectures"] = serde_json::json!([]);
    install_plugin(root.path(), "e_noarch", "cpu", m, Some(&faulty));
    let mut m = faulty_manifest("gpu");
    m["gpu_backend"] = "cuda".into();
    install_plugin(root.path(), "f_gpu", "cuda", m, Some(&faulty));
    let mut m = faulty_manifest("badver");
    m["version"] = "1.0".into();
    install_plugin(root.path(), "g_schema", "cpu", m, Some(&faulty));
    let mut m = faulty_manifest("pinned");
    m["sha256"] = "0".repeat(64).into();
    install_plugin(root.path(), "h_sha", "cpu", m, Some(&faulty));

    let reg = EngineRegistry::discover(root.path(), &cpu_config());

    assert!(
        matches!(reg.records[0].state, PluginState::Loaded(_)),
        "the first faulty plugin loads"
    );
    assert_eq!(
        refusal(&reg, "b_dup"),
        "Plugin ID conflict: faulty already loaded"
    );
    assert_eq!(
        refusal(&reg, "c_abi"),
        "ABI version mismatch: expected 1, got 2"
    );
    let nobin = root.path().join("d_nobin/cpu/libmissing.so");
    assert_eq!(
        refusal(&reg, "d_nobin"),
        format!("Binary not found: {}", nobin.display())
    );
    assert_eq!(refusal(&reg, "e_noarch"), "No architectures specified");
    assert_eq!(refusal(&reg, "f_gpu"), "GPU backend mismatch");
    assert!(
        refusal(&reg, "g_schema").contains("`version` must match"),
        "{}",
        refusal(&reg, "g_schema")
    );
    assert!(
        refusal(&reg, "h_sha").starts_with("sha256 mismatch"),
        "{}",
        refusal(&reg, "h_sha")
    );
    assert_eq!(reg.records.len(), 8);
    // The node keeps going: the healthy plugin still serves.
    let plugin = reg.plugin("faulty").expect("faulty loaded");
    let (_shared, mut exec) = plugin.load_model(&toy_desc("toy")).expect("load");
    let seq = exec.seq_open().expect("seq");
    let g = Sampling::greedy();
    let out = exec
        .step(&[StepEntry {
            seq,
            tokens: &[7],
            sample: Some(&g),
            fresh: false,
            allowed: None,
            sample_all: false,
        }])
        .expect("step");
    assert_eq!(out[0].as_ref().map(|t| t.token), Some(8));
}

#[test]
fn a_cuda_node_refuses_a_cpu_plugin_as_a_backend_mismatch() {
    let root = tempfile::tempdir().expect("tempdir");
    install_faulty(root.path());
    let cfg = EngineConfig {
        backend: Backend::Cuda,
        ..cpu_config()
    };
    let reg = EngineRegistry::discover(root.path(), &cfg);
    assert_eq!(refusal(&reg, "faulty"), "GPU backend mismatch");
}

#[test]
fn an_abi_mismatch_is_refused_having_called_only_the_entry_symbol() {
    let root = tempfile::tempdir().expect("tempdir");
    // The plugin traces each call to a per-process file (see engines/faults/wrong-abi).
    let trace = std::env::temp_dir().join(format!("gantry-fault-trace-{}", std::process::id()));
    let _ = std::fs::remove_file(&trace);
    let mut m = faulty_manifest("wrongabi");
    m["binary"] = "libgantry_fault_wrong_abi.so".into();
    install_plugin(
        root.path(),
        "wrongabi",
        "cpu",
        m,
        Some(&built_lib("gantry_fault_wrong_abi")),
    );
    let reg = EngineRegistry::discover(root.path(), &cpu_config());
    assert_eq!(
        refusal(&reg, "wrongabi"),
        "ABI version mismatch: expected 1, got 99"
    );
    let calls = std::fs::read_to_string(&trace).expect("the plugin traced its entry call");
    assert_eq!(
        calls.lines().collect::<Vec<_>>(),
        vec!["entry"],
        "only the entry symbol may be called"
    );
}

#[test]
fn a_library_that_cannot_be_loaded_is_refused_with_the_loaders_reason() {
    // A real shared library whose dependency is missing: the refusal names the dependency,
    // not only "dlopen failed" (the case of a CUDA plugin on a node without the CUDA runtime).
    let root = tempfile::tempdir().expect("tempdir");
    let src = root.path().join("needs.c");
    std::fs::write(&src, "void gantry_needs(void) {}\n").expect("source");
    let dep = root.path().join("libgantry_missing_dep.so");
    let cc = |args: &[&str]| {
        let ok = std::process::Command::new("cc")
            .args(args)
            .status()
            .expect("cc")
            .success();
        assert!(ok, "cc {args:?}");
    };
    cc(&[
        "-shared",
        "-fPIC",
        "-o",
        dep.to_str().expect("utf-8"),
        src.to_str().expect("utf-8"),
    ]);
    let lib = root.path().join("libneeds.so");
    cc(&[
        "-shared",
        "-fPIC",
        "-o",
        lib.to_str().expect("utf-8"),
        src.to_str().expect("utf-8"),
        "-L",
        root.path().to_str().expect("utf-8"),
        "-Wl,--no-as-needed",
        "-lgantry_missing_dep",
    ]);
    std::fs::remove_file(&dep).expect("remove the dependency");
    let mut m = faulty_manifest("needs");
    m["binary"] = "libneeds.so".into();
    install_plugin(root.path(), "needs", "cpu", m, Some(&lib));
    let reg = EngineRegistry::discover(root.path(), &cpu_config());
    let reason = refusal(&reg, "needs");
    assert!(reason.starts_with("cannot load "), "{reason}");
    assert!(reason.contains("libgantry_missing_dep.so"), "{reason}");
}

#[test]
fn a_library_without_the_entry_symbol_is_refused() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut m = faulty_manifest("noentry");
    m["binary"] = "libgantry_fault_no_entry.so".into();
    let lib = built_lib("gantry_fault_no_entry");
    install_plugin(root.path(), "noentry", "cpu", m, Some(&lib));
    let reg = EngineRegistry::discover(root.path(), &cpu_config());
    let reason = refusal(&reg, "noentry");
    assert!(
        reason.starts_with("entry symbol gantry_engine_entry not found"),
        "{reason}"
    );
}

#[test]
fn a_plugin_reporting_another_id_than_its_manifest_is_refused() {
    let root = tempfile::tempdir().expect("tempdir");
    install_plugin(
        root.path(),
        "impostor",
        "cpu",
        faulty_manifest("impostor"),
        Some(&built_lib("gantry_fault_faulty")),
    );
    let reg = EngineRegistry::discover(root.path(), &cpu_config());
    assert!(refusal(&reg, "impostor").contains("reports id \"faulty\""));
}

#[test]
fn a_panic_in_step_comes_back_as_internal_and_the_host_keeps_working() {
    let root = tempfile::tempdir().expect("tempdir");
    install_faulty(root.path());
    let reg = EngineRegistry::discover(root.path(), &cpu_config());
    let plugin = reg.plugin("faulty").expect("loaded");
    let g = Sampling::greedy();

    let (_s, mut panicky) = plugin.load_model(&toy_desc("panic-model")).expect("load");
    let seq = panicky.seq_open().expect("seq");
    let err = panicky
        .step(&[StepEntry {
            seq,
            tokens: &[1],
            sample: Some(&g),
            fresh: false,
            allowed: None,
            sample_all: false,
        }])
        .expect_err("must fail");
    assert_eq!(err.status, Status::Internal);
    assert!(
        err.message
            .contains("plugin panicked: injected panic in step"),
        "{}",
        err.message
    );
    assert_eq!(err.status.http_status(), 500);

    // The same plugin still serves another model, and the panicky one still answers.
    let (_s2, mut healthy) = plugin.load_model(&toy_desc("healthy")).expect("load");
    let seq2 = healthy.seq_open().expect("seq");
    let out = healthy
        .step(&[StepEntry {
            seq: seq2,
            tokens: &[41],
            sample: Some(&g),
            fresh: false,
            allowed: None,
            sample_all: false,
        }])
        .expect("step");
    assert_eq!(out[0].as_ref().map(|t| t.token), Some(42));
    panicky.seq_release(seq);
}

#[test]
fn an_oom_at_load_comes_back_with_its_code_and_message() {
    let root = tempfile::tempdir().expect("tempdir");
    install_faulty(root.path());
    let reg = EngineRegistry::discover(root.path(), &cpu_config());
    let err = reg
        .plugin("faulty")
        .expect("loaded")
        .load_model(&toy_desc("oom-big"))
        .expect_err("oom");
    assert_eq!(err.status, Status::OomVram);
    assert_eq!(err.status.http_status(), 507);
    assert!(err.message.contains("does not fit"));
}

#[test]
fn resolve_names_every_candidate_and_its_reason_and_never_falls_back() {
    let root = tempfile::tempdir().expect("tempdir");
    let faulty = built_lib("gantry_fault_faulty");
    install_faulty(root.path());
    let mut m = faulty_manifest("gpuonly");
    m["gpu_backend"] = "cuda".into();
    install_plugin(root.path(), "gpuonly", "cuda", m, Some(&faulty));
    let reg = EngineRegistry::discover(root.path(), &cpu_config());

    assert_eq!(
        reg.resolve(Format::Gguf, "toy", None, &[]),
        EngineVerdict::Supported {
            plugin: "faulty".into(),
            version: "0.1.0".into()
        }
    );
    let EngineVerdict::Unsupported { rejections } = reg.resolve(Format::Gguf, "mamba", None, &[])
    else {
        panic!("mamba must be unsupported")
    };
    let kinds: Vec<_> = rejections
        .iter()
        .map(|r| (r.plugin.as_str(), r.kind))
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("faulty", RejectionKind::Architecture),
            ("gpuonly", RejectionKind::Backend)
        ]
    );
    assert!(rejections[0].reason.contains("architecture mamba"));

    let EngineVerdict::Unsupported { rejections } =
        reg.resolve(Format::Safetensors, "toy", None, &[])
    else {
        panic!("safetensors must be unsupported: no fallback to gguf")
    };
    assert_eq!(rejections[0].kind, RejectionKind::Format);

    let EngineVerdict::Unsupported { rejections } =
        reg.resolve(Format::Gguf, "toy", Some("vllm"), &[])
    else {
        panic!("a pin to a missing engine is never overridden")
    };
    assert!(rejections.iter().all(|r| r.kind == RejectionKind::Pin));
    assert!(
        rejections
            .iter()
            .any(|r| r.reason.contains("not installed"))
    );
}

#[test]
fn the_default_plugin_tree_from_the_build_holds_llama_cpp() {
    let dir = profile_dir().join("engines");
    let reg = EngineRegistry::discover(&dir, &cpu_config());
    let rec = reg.get("llama_cpp").expect("llama_cpp discovered");
    let s = rec.summary();
    assert_eq!(s.status, "loaded", "{:?}", s.reason);
    assert_eq!(s.modalities, vec!["completion", "embedding"]);
    assert!(s.architectures.iter().any(|a| a == "gemma3"));
    assert!(s.license.is_some());
}

/// Compile `source` (C99, against the header, with `examples/c` on the include path) into an
/// `echo` plugin under `root`, discover it and return it.
fn c_echo_plugin(root: &Path, source: &Path) -> Plugin {
    let abi = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engines/abi");
    let dir = root.join("echo/cpu");
    std::fs::create_dir_all(&dir).expect("dir");
    let status = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args([
            "-std=c99", "-Wall", "-Werror", "-O2", "-shared", "-fPIC", "-I",
        ])
        .arg(abi.join("include"))
        .arg("-I")
        .arg(abi.join("examples/c"))
        .arg(source)
        .arg("-o")
        .arg(dir.join("libecho_engine.so"))
        .status()
        .expect("a C compiler");
    assert!(
        status.success(),
        "{} must compile cleanly",
        source.display()
    );
    let mut m = faulty_manifest("echo");
    m["version"] = "1.0.0".into();
    m["binary"] = "libecho_engine.so".into();
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec(&m).expect("json"),
    )
    .expect("manifest");
    let reg = EngineRegistry::discover(root, &cpu_config());
    reg.plugin("echo")
        .unwrap_or_else(|| panic!("echo refused: {:?}", reg.records[0].summary().reason))
        .clone()
}

#[test]
fn a_plugin_written_in_c_against_the_header_loads_and_steps() {
    let root = tempfile::tempdir().expect("tempdir");
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../engines/abi/examples/c/echo_engine.c");
    let plugin = c_echo_plugin(root.path(), &example);
    assert_eq!(
        plugin.info().description.as_deref(),
        Some("byte echo engine written in C")
    );
    let (shared, mut exec) = plugin.load_model(&toy_desc("echo")).expect("load");
    assert_eq!(shared.info().architecture, "toy");
    let toks = shared.tokenize("hi", false, false).expect("tokenize");
    assert_eq!(toks, vec![104, 105]);
    let (seq, token) = step_new_sequence(&mut exec, &toks, false);
    assert_eq!(token, 106);
    // ABI 1.4: echo keeps no cache, so its sequence took nothing from one.
    assert_eq!(exec.seq_cached_tokens(seq), Some(0));
    assert_eq!(
        exec.seq_cached_tokens(seq + 1000),
        None,
        "an unknown sequence"
    );
    let err = exec.embed(&toks).expect_err("no embeddings");
    assert_eq!(
        (err.status, err.message.as_str()),
        (Status::Unsupported, "echo has no embeddings")
    );
    // ABI 1.8: the example leaves `embed_batch` empty, so the host calls `embed` per input
    // and names the input that failed.
    let err = exec
        .embed_batch(&[toks.clone(), toks])
        .expect_err("no embeddings");
    assert_eq!(
        (err.status, err.message.as_str()),
        (Status::Unsupported, "input 0: echo has no embeddings")
    );
    // ABI 1.9: the example leaves `seq_set_input` empty: a sequence given audio is refused
    // with the reason, and keeps stepping.
    let err = exec
        .seq_set_input(
            seq,
            &gantry_engine_abi::Input::Audio {
                samples: &[0.0; 160],
                sample_rate: 16_000,
                align: false,
            },
        )
        .expect_err("no inputs");
    assert_eq!(
        (err.status, err.message.as_str()),
        (
            Status::Unsupported,
            "the plugin takes no inputs (no ABI 1.9 seq_set_input)"
        )
    );
    assert!(!shared.info().supports_transcription());
    assert_eq!(shared.info().audio_sample_rate, 0);
    // ABI 1.11: nor `seq_token_times` or `seq_token_prob`: each is refused with the reason.
    let err = exec.seq_token_times(seq, 0).expect_err("no times");
    assert_eq!(
        (err.status, err.message.as_str()),
        (
            Status::Unsupported,
            "the plugin does not align tokens with their audio (no ABI 1.11 seq_token_times)"
        )
    );
    let err = exec.seq_token_prob(seq, 1, 0).expect_err("no probability");
    assert_eq!(
        (err.status, err.message.as_str()),
        (
            Status::Unsupported,
            "the plugin does not report a token's probability (no ABI 1.11 seq_token_prob)"
        )
    );
}

#[test]
fn a_plugin_built_before_abi_1_4_loads_steps_and_reports_no_cached_tokens() {
    let root = tempfile::tempdir().expect("tempdir");
    // The echo example with the vtable an ABI 1.3 build exports: `struct_size` ends before
    // `seq_cached_tokens`, and the slot past it holds garbage the host must not call.
    let source = root.path().join("echo_1_3.c");
    std::fs::write(
        &source,
        r#"#include <stddef.h>
#define gantry_engine_entry echo_entry_1_4
#include "echo_engine.c"
#undef gantry_engine_entry

static gantry_engine_vtable_t OLD_VTABLE;
static gantry_engine_entry_t OLD_ENTRY;

const gantry_engine_entry_t* gantry_engine_entry(void) {
    const gantry_engine_entry_t* e = echo_entry_1_4();
    OLD_VTABLE = *e->vtable;
    OLD_VTABLE.struct_size = offsetof(gantry_engine_vtable_t, seq_cached_tokens);
    OLD_VTABLE.seq_cached_tokens = (int64_t (*)(gantry_model_t*, uint64_t))(uintptr_t)1;
    OLD_ENTRY = *e;
    OLD_ENTRY.abi_minor = 3;
    OLD_ENTRY.vtable = &OLD_VTABLE;
    return &OLD_ENTRY;
}
"#,
    )
    .expect("write source");
    let plugin = c_echo_plugin(root.path(), &source);
    let (shared, mut exec) = plugin.load_model(&toy_desc("echo")).expect("load");
    let toks = shared.tokenize("hi", false, false).expect("tokenize");
    let (seq, token) = step_new_sequence(&mut exec, &toks, false);
    assert_eq!(token, 106);
    assert_eq!(
        exec.seq_cached_tokens(seq),
        None,
        "a 1.3 plugin reports nothing"
    );
}
