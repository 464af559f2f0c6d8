//! Native engine, CUDA backend: what can be checked on any machine, and the GPU checks.
//!
//! On every machine: the kernels compile with NVRTC for each GPU generation the images target
//! (NVRTC needs no GPU; `scripts/setup.sh` installs it from PyPI and exports
//! `GANTRY_NVRTC_LIB`), and the engine asked for the cuda backend either starts (a GPU is
//! there) or refuses with the reason (none is), never crashes.
//!
//! On a machine with an NVIDIA GPU (`scripts/gpu-check.sh` runs them with `--ignored`; they are
//! listed as ignored everywhere else, never as passed): the CUDA and CPU backends give the same
//! logits on every tiny architecture, prompt and decode steps through the paged cache, and the
//! real Gemma 3 270M answers " Paris" on the GPU; a LoRA adapter is refused there (ABI 1.6: the
//! CPU backend runs them), never served as the base.
#![allow(unsafe_code)] // An engine crate's test: opens NVRTC by path (libloading); SAFETY noted.

use std::path::Path;
use std::sync::Arc;

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    AdapterDescriptor, Backend as AbiBackend, EngineConfig, Format, Sampling, Status, StepEntry,
};
use gantry_engine_native::backend::{Backend, StepInput};
use gantry_engine_native::cpu::CpuBackend;
use gantry_engine_native::cuda::{self, CudaBackend, KERNEL_NAMES};
use gantry_engine_native::weights::Weights;
use gantry_engine_native::{DecoderModel, NativeEngine};
use gantry_testkit::hf::{HfFamily, write_tiny_hf, write_tiny_hf_with_head_dim};

mod common;
use common::*;

/// Open the NVRTC library `scripts/setup.sh` installed, by its path. Once loaded, cudarc's
/// open by name (`libnvrtc.so.12`) finds it by its soname.
fn load_nvrtc() {
    let lib = env_path("GANTRY_NVRTC_LIB");
    // SAFETY: NVRTC's initialisers only set up the library; it is kept loaded for the process.
    let l = unsafe { libloading::Library::new(&lib) }
        .unwrap_or_else(|e| panic!("opening {}: {e}", lib.display()));
    std::mem::forget(l);
}

#[test]
fn the_kernels_compile_for_every_gpu_generation_the_images_target() {
    load_nvrtc();
    // Turing, Ampere (A100, A10/RTX 30), Ada (L4/L40), Hopper (H100/H200).
    for (major, minor) in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0)] {
        let cubin =
            cuda::compile(major, minor).unwrap_or_else(|e| panic!("sm_{major}{minor}: {e}"));
        assert_eq!(&cubin[..4], b"\x7fELF", "sm_{major}{minor}: not a cubin");
        for name in KERNEL_NAMES {
            let sym = format!("{name}\0");
            assert!(
                cubin.windows(sym.len()).any(|w| w == sym.as_bytes()),
                "sm_{major}{minor}: kernel {name} is missing from the cubin"
            );
        }
    }
}

#[test]
fn a_compile_error_is_reported_with_the_compilers_log() {
    load_nvrtc();
    // An architecture NVRTC does not know: the error carries NVRTC's own message.
    let err = cuda::compile(1, 0).expect_err("sm_10 does not exist");
    assert!(err.contains("sm_10"), "{err}");
}

#[test]
fn the_cuda_backend_starts_where_a_gpu_is_and_is_refused_with_the_reason_where_none_is() {
    let cfg = EngineConfig {
        backend: AbiBackend::Cuda,
        ..EngineConfig::default()
    };
    let created = NativeEngine::create(cfg, HostLog::discard());
    match cuda::unavailable() {
        Some(why) => {
            let err = created
                .err()
                .expect("no GPU here: the cuda backend must be refused");
            assert_eq!(err.message, format!("backend: cuda unavailable: {why}"));
            eprintln!(
                "no GPU on this machine, refused as expected: {}",
                err.message
            );
        }
        None => {
            created.expect("a GPU is here: the cuda backend starts");
        }
    }
    // The CPU backend is unaffected either way.
    NativeEngine::create(EngineConfig::default(), HostLog::discard()).expect("cpu backend");
}

/// One prompt step of two sequences (prompts of 9 and 5 tokens, across block boundaries of
/// 4-token blocks) and one decode step of each, on a backend; the logits of every sampled row.
fn two_steps(b: &mut dyn Backend) -> Vec<Vec<f32>> {
    let prompts = vec![(1..10).collect(), vec![7, 3, 9, 2, 5]];
    steps(b, &prompts, &[vec![0, 1, 2], vec![3, 4]], &[11, 12])
}

/// One prompt step of `prompts` (sequence i in the blocks of `tables[i]`) and one decode step
/// of each with its token of `next`; the logits of every sampled row.
fn steps(
    b: &mut dyn Backend,
    prompts: &[Vec<i32>],
    tables: &[Vec<u32>],
    next: &[i32],
) -> Vec<Vec<f32>> {
    let tables: Vec<&[u32]> = tables.iter().map(Vec::as_slice).collect();
    let (mut tokens, mut positions, mut seq_of, mut last) = (vec![], vec![], vec![], vec![]);
    for (s, p) in prompts.iter().enumerate() {
        tokens.extend(p);
        positions.extend(0..p.len());
        seq_of.extend(std::iter::repeat_n(s, p.len()));
        last.push(tokens.len() - 1);
    }
    let slots: Vec<usize> = (0..prompts.len()).collect();
    let prompt = b
        .forward(&StepInput {
            tokens: &tokens,
            positions: &positions,
            seq_of: &seq_of,
            tables: &tables,
            logits_rows: &last,
            adapters: &[],
            slots: &slots,
        })
        .expect("prompt step");
    let at: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let decode = b
        .forward(&StepInput {
            tokens: next,
            positions: &at,
            seq_of: &slots,
            tables: &tables,
            logits_rows: &slots,
            adapters: &[],
            slots: &slots,
        })
        .expect("decode step");
    vec![prompt, decode]
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn cuda_and_cpu_backends_agree_on_every_tiny_architecture() {
    for family in HfFamily::ALL {
        cuda_and_cpu_agree(family, None);
    }
}

/// Head sizes of real models: 128 (Llama 3, Qwen3) and 256 (Gemma 3), where attention reads
/// each lane's K/V values in one 8- or 16-byte load (bf16 Qwen3) or value by value (f32
/// Gemma 3), and four query heads share a block.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn cuda_and_cpu_backends_agree_with_real_head_sizes() {
    for family in [HfFamily::Qwen3, HfFamily::Gemma3] {
        for hd in [128, 256] {
            cuda_and_cpu_agree(family, Some(hd));
        }
    }
}

/// Decode steps of 1 to 8 sequences over 16-bit weights (f16 Mistral, bf16 Qwen3): one token's
/// products run on the `gemv` kernel, more on cuBLAS (the two-sequence steps of
/// [`two_steps`] take `gemv`'s two-token instance).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn cuda_and_cpu_backends_agree_on_decode_batches_of_one_to_eight() {
    for family in [HfFamily::Mistral, HfFamily::Qwen3] {
        for k in [1, 3, 4, 5, 8] {
            compare(family, None, 3 * k, &|b| batch_steps(b, k));
        }
    }
}

/// One prompt step of `k` sequences (prompts of 3 to 9 tokens, 4-token blocks, three blocks
/// each) and one decode step of each; the logits of every sampled row.
fn batch_steps(b: &mut dyn Backend, k: usize) -> Vec<Vec<f32>> {
    let prompts: Vec<Vec<i32>> = (0..k)
        .map(|s| {
            (0..3 + (2 * s) % 7)
                .map(|j| ((s * 5 + j) % 50 + 1) as i32)
                .collect()
        })
        .collect();
    let tables: Vec<Vec<u32>> = (0..k)
        .map(|s| (0..3).map(|j| (3 * s + j) as u32).collect())
        .collect();
    let next: Vec<i32> = (0..k).map(|s| (s + 11) as i32).collect();
    steps(b, &prompts, &tables, &next)
}

/// Key spans longer than one tile of `attention_tiled` and than one piece of the split: a
/// 300-token and a 70-token prompt in one step (long enough for the prompt step to go
/// unsplit), then a decode step of both (each piece several tiles long), on every tiny
/// architecture (sliding windows of 4 and 8 included) and with head sizes 128 and 256.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn cuda_and_cpu_backends_agree_over_spans_of_several_tiles() {
    let run = |b: &mut dyn Backend| {
        let prompts: Vec<Vec<i32>> = [300usize, 70]
            .iter()
            .map(|&len| (0..len).map(|j| ((j * 7) % 50 + 1) as i32).collect())
            .collect();
        let tables = vec![(0..76).collect(), (76..94).collect()];
        steps(b, &prompts, &tables, &[11, 12])
    };
    let mut cases: Vec<(HfFamily, Option<usize>)> =
        HfFamily::ALL.into_iter().map(|f| (f, None)).collect();
    cases.extend([(HfFamily::Qwen3, Some(128)), (HfFamily::Gemma3, Some(256))]);
    for (family, head_dim) in cases {
        compare(family, head_dim, 96, &run);
    }
}

/// The CUDA and CPU backends' logits of [`two_steps`] on a tiny `family` model (see
/// [`compare`]).
fn cuda_and_cpu_agree(family: HfFamily, head_dim: Option<usize>) {
    compare(family, head_dim, 8, &two_steps);
}

/// The CUDA and CPU backends' logits of `run` on a tiny `family` model with `n_blocks` KV
/// blocks of 4 tokens: within 2 % of the largest logit, and the same greedy token wherever the
/// top two are further apart.
fn compare(
    family: HfFamily,
    head_dim: Option<usize>,
    n_blocks: usize,
    run: &dyn Fn(&mut dyn Backend) -> Vec<Vec<f32>>,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf_with_head_dim(dir.path(), family, 7, head_dim).expect("tiny model");
    let mc = DecoderModel::model_config(dir.path()).expect("config");
    let primary = st_desc("tiny", dir.path()).primary_file;
    let weights = Arc::new(Weights::open(dir.path(), &primary).expect("weights"));
    let bs = 4;
    let mut cpu = CpuBackend::new(&mc, Arc::clone(&weights), n_blocks, bs, 2, 8).expect("cpu");
    let mut gpu = CudaBackend::new(&mc, &weights, n_blocks, bs, 0).expect("cuda");
    let want = run(&mut cpu);
    let got = run(&mut gpu);
    for (step, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.len(), g.len());
        let scale = w.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let diff = w
            .iter()
            .zip(g)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!(
            "{} (head_dim {head_dim:?}): step {step}: max |logit| {scale:.3}, max abs difference {diff:.2e}",
            family.name()
        );
        // bf16 products round the activations on the GPU and on CPUs with the AVX-512
        // BF16 kernel only; 2 % of the largest logit covers that rounding.
        assert!(
            diff <= 0.02 * scale,
            "{}: step {step}: CUDA and CPU logits differ by {diff} (largest logit {scale})",
            family.name()
        );
        for (r, (wr, gr)) in w
            .chunks_exact(mc.vocab)
            .zip(g.chunks_exact(mc.vocab))
            .enumerate()
        {
            let argmax = |v: &[f32]| {
                v.iter().enumerate().fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                )
            };
            let (wi, wv) = argmax(wr);
            let (gi, _) = argmax(gr);
            // A different argmax only where the two top logits are within the tolerance.
            assert!(
                wi == gi || (wv - gr[wi]).abs() <= 0.02 * scale,
                "{}: step {step} row {r}: greedy token {wi} on the CPU, {gi} on CUDA",
                family.name()
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn a_model_on_cuda_refuses_lora_adapters_instead_of_answering_with_the_base() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), HfFamily::Llama, 0).expect("write");
    let engine = NativeEngine::create(
        EngineConfig {
            backend: AbiBackend::Cuda,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )
    .expect("cuda engine");
    let model = engine
        .load_model(&st_desc("tiny", dir.path()))
        .expect("load on the GPU");
    let err = model
        .adapter_load(&AdapterDescriptor {
            name: "any".into(),
            path: dir.path().join("adapter"),
            format: Format::Safetensors,
            scale: 1.0,
        })
        .expect_err("the CUDA backend runs no adapters yet");
    assert_eq!(err.status, Status::Unsupported);
    assert!(
        err.message.contains("LoRA adapters run on the CPU backend of the native engine; CUDA support is not built yet"),
        "{}",
        err.message
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check.sh runs it"]
fn gemma_on_cuda_answers_paris() {
    let dir = env_path("GANTRY_GEMMA_ST_DIR");
    let engine = NativeEngine::create(
        EngineConfig {
            backend: AbiBackend::Cuda,
            max_batch_size: 8,
            context_length: 512,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )
    .expect("cuda engine");
    let model = engine
        .load_model(&st_desc("gemma-st", Path::new(&dir)))
        .expect("load on the GPU");
    let prompt = model
        .tokenize(
            b"Question: What is the capital of France?\nAnswer:",
            true,
            false,
        )
        .expect("tokenize");
    let seq = model.seq_open().expect("seq");
    let greedy = Sampling::greedy();
    let mut feed = prompt;
    let mut out = Vec::new();
    for _ in 0..3 {
        let r = model
            .step(&[StepEntry {
                seq,
                tokens: &feed,
                sample: Some(&greedy),
                fresh: false,
                allowed: None,
                sample_all: false,
            }])
            .expect("step");
        let t = r[0].as_ref().expect("sampled").token;
        out.push(t);
        feed = vec![t];
    }
    model.seq_release(seq);
    let text = String::from_utf8_lossy(&model.detokenize(&out, false).expect("text")).into_owned();
    eprintln!("gemma on CUDA: {text:?}; {}", model.info().bytes_used);
    assert!(text.starts_with(" Paris"), "{text:?}");
}
