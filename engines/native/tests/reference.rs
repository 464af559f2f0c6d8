//! The native engine against Hugging Face transformers, the independent reference (load and
//! forward pass, through the node's engine host as `gantry-node` runs the plugin).
//!
//! `testkit/python/hf_reference.py` (run by `scripts/setup.sh`, which exports
//! `GANTRY_HF_REFERENCE`) writes tiny random checkpoints of every architecture the engine runs
//! with transformers' own `from_config` and `save_pretrained`, in float32 and bfloat16, and
//! records transformers' log-probabilities over the whole vocabulary at every prompt position,
//! its greedy `generate` continuation (32 tokens), and the log-probabilities at each generated
//! position. Here the engine loads each checkpoint and, comparing at every position the
//! log-probabilities of the engine's 20 most likely tokens (the ABI's `top_logprobs` limit;
//! log-probabilities, so the normalisation over the whole vocabulary is compared too):
//! - evaluates each prompt in one step that samples after every token (every position's
//!   distribution), then decodes the reference's continuation one token per step (its KV
//!   cache, as in serving), comparing every distribution with transformers';
//! - does so for each prompt alone and for all prompts in one batch that later prompts join
//!   mid-decode (the batched step, the mixture-of-experts dispatch grouping tokens of several
//!   sequences), which must agree;
//! - on float32 checkpoints, picks transformers' greedy token at every step (the same 32-token
//!   continuation); on bfloat16 ones the agreement is counted and printed.
//!
//! The largest differences are printed per checkpoint (`cargo test -- --nocapture`).

use std::path::Path;

use gantry_engine_abi::{Sampling, StepEntry};
use gantry_node::engine_host::ModelExec;
use serde_json::Value;

mod common;
use common::*;

/// Every architecture the reference covers (`hf_reference.py`'s `ARCHS`), by directory stem.
const ARCHS: [&str; 11] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "qwen3-moe",
    "mixtral",
    "qwen2-moe",
    "bamba",
    "granite-hybrid",
    "granite-hybrid-dense",
];

/// Largest |engine − transformers| log-probability accepted, by checkpoint dtype. Both sides
/// compute in f32, and for bfloat16 weights the reference matches the engine's products (on a
/// CPU with the bf16 kernel it rounds each linear layer's input to bf16 as the kernel does).
/// float32: what is left is summation order (measured: under 1e-5). bfloat16: rounding
/// activations to 8 bits of mantissa makes every last-bit difference in a sum a possible
/// 2^-8 step in the next product's input; transformers itself moves position 0's
/// log-probabilities by up to 2e-2 when only the prompt's length changes (its CPU products take
/// another path), so the bound is that of bf16 arithmetic (measured: under 4e-2), and greedy
/// decoding is compared on float32 only.
fn tolerance(dtype: &str) -> f32 {
    if dtype == "float32" { 1e-3 } else { 6e-2 }
}

struct Reference {
    class: String,
    prompts: Vec<Vec<i32>>,
    prompt_logprobs: Vec<Vec<Vec<f32>>>,
    greedy: Vec<Vec<i32>>,
    greedy_logprobs: Vec<Vec<Vec<f32>>>,
}

fn ints(v: &Value) -> Vec<i32> {
    v.as_array()
        .expect("a list of token ids")
        .iter()
        .map(|t| t.as_i64().expect("a token id") as i32)
        .collect()
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .expect("a list of distributions")
        .iter()
        .map(|r| {
            r.as_array()
                .expect("a distribution")
                .iter()
                .map(|x| x.as_f64().expect("a log-probability") as f32)
                .collect()
        })
        .collect()
}

/// The reference of the checkpoint in `dir`: for bfloat16 weights run by the engine's bf16
/// kernel (`rounded`), the one computed with bf16-rounded activations.
fn read_reference(dir: &Path, rounded: bool) -> Reference {
    let path = dir.join("reference.json");
    let top: Value = serde_json::from_slice(
        &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .expect("reference.json");
    let v = match &top["bf16_activations"] {
        Value::Null => &top,
        r if rounded => r,
        _ => &top,
    };
    let each = |key: &str| v[key].as_array().expect(key).clone();
    Reference {
        class: top["class"].as_str().expect("class").to_string(),
        prompts: top["prompts"]
            .as_array()
            .expect("prompts")
            .iter()
            .map(ints)
            .collect(),
        prompt_logprobs: each("prompt_logprobs").iter().map(rows).collect(),
        greedy: each("greedy").iter().map(ints).collect(),
        greedy_logprobs: each("greedy_logprobs").iter().map(rows).collect(),
    }
}

/// The most likely tokens at one position and their log-probabilities, best first.
type Top = Vec<(i32, f32)>;

/// What the engine computed for one prompt: every prompt position's top tokens, each decode
/// step's (teacher-forced with the reference's tokens), and the token each decode step picked.
#[derive(Default)]
struct Run {
    prompt: Vec<Top>,
    decode: Vec<Top>,
    picked: Vec<i32>,
}

/// How many top tokens the ABI returns per position.
const TOP: usize = 20;

/// Where a sequence of [`run`] stands.
#[derive(Clone, Copy)]
enum Stage {
    /// Not in yet.
    Waiting,
    /// This many of its prompt tokens went in (the first in a plain sampled step: position 0's
    /// distribution).
    Started(usize),
    /// Its prompt is in; this many forced tokens were fed since.
    Decoding(usize),
}

/// How the rest of a prompt goes in after its first token.
#[derive(Clone, Copy, PartialEq)]
enum Feed {
    /// One entry that samples after every token (a verification entry: every position's
    /// distribution; an engine verifies only a sequence it has stepped).
    Verify,
    /// One token per step, each sampled (recurrent models, whose state cannot take a
    /// verification entry).
    OneByOne,
    /// One entry sampled after its last token: [`Run::prompt`] holds positions 0 and last
    /// only (the chunked prompt path of a recurrent model).
    Whole,
}

impl Feed {
    /// The prompt positions of `rows` (one per position) that a run fed this way samples.
    fn expected<T: Clone>(self, rows: &[T]) -> Vec<T> {
        match self {
            Feed::Whole => vec![rows[0].clone(), rows[rows.len() - 1].clone()],
            _ => rows.to_vec(),
        }
    }
}

/// Run `prompts` through the engine together: prompt `i` joins at step `join_at[i]` with its
/// first token, then the rest of its prompt as `feed` says, then decodes `forced[i]` one token
/// per step.
fn run(
    exec: &mut ModelExec,
    prompts: &[Vec<i32>],
    forced: &[Vec<i32>],
    join_at: &[usize],
    feed: Feed,
) -> Vec<Run> {
    let all = Sampling {
        top_logprobs: TOP as u32,
        want_logprob: true,
        ..Sampling::greedy()
    };
    let seqs: Vec<u64> = prompts
        .iter()
        .map(|_| exec.seq_open().expect("seq_open"))
        .collect();
    let mut out: Vec<Run> = prompts.iter().map(|_| Run::default()).collect();
    let mut stage = vec![Stage::Waiting; prompts.len()];
    let mut step = 0;
    while (0..prompts.len())
        .any(|i| !matches!(stage[i], Stage::Decoding(n) if n >= forced[i].len()))
    {
        let mut entries = Vec::new();
        let mut who = Vec::new();
        for i in 0..prompts.len() {
            let (tokens, first, verify): (&[i32], bool, bool) = match stage[i] {
                Stage::Waiting if step >= join_at[i] => (&prompts[i][..1], true, false),
                Stage::Waiting => continue,
                Stage::Started(k) if feed == Feed::OneByOne => {
                    (&prompts[i][k..k + 1], false, false)
                }
                Stage::Started(k) => (&prompts[i][k..], false, feed == Feed::Verify),
                Stage::Decoding(n) if n < forced[i].len() => (&forced[i][n..n + 1], false, false),
                Stage::Decoding(_) => continue,
            };
            entries.push(StepEntry {
                seq: seqs[i],
                tokens,
                sample: Some(&all),
                fresh: first,
                allowed: None,
                sample_all: verify,
            });
            who.push((i, if verify { tokens.len() } else { 1 }, tokens.len()));
        }
        let results = exec.step(&entries).expect("step");
        drop(entries);
        let mut slots = results.into_iter();
        for (i, n, fed) in who {
            let mut tops = Vec::with_capacity(n);
            let mut token = 0;
            for _ in 0..n {
                let t = slots.next().flatten().expect("a sampled slot");
                assert_eq!(t.top.len(), TOP, "top_logprobs");
                token = t.token;
                tops.push(t.top);
            }
            stage[i] = match stage[i] {
                Stage::Waiting => {
                    out[i].prompt.extend(tops);
                    Stage::Started(1)
                }
                Stage::Started(k) if k + fed < prompts[i].len() => {
                    out[i].prompt.extend(tops);
                    Stage::Started(k + fed)
                }
                Stage::Started(_) => {
                    out[i].prompt.extend(tops);
                    // The prompt's last distribution is also the first decode step's.
                    let last = out[i].prompt.last().expect("a prompt").clone();
                    out[i].picked.push(last[0].0);
                    out[i].decode.push(last);
                    Stage::Decoding(0)
                }
                Stage::Decoding(fed) => {
                    out[i].decode.extend(tops);
                    out[i].picked.push(token);
                    Stage::Decoding(fed + 1)
                }
            };
        }
        step += 1;
    }
    for s in seqs {
        exec.seq_release(s);
    }
    // The last forced token's step samples past the reference's continuation: drop it.
    for (r, f) in out.iter_mut().zip(forced) {
        r.decode.truncate(f.len());
        r.picked.truncate(f.len());
    }
    out
}

/// Largest |engine − reference| over the engine's top tokens at every position.
fn max_diff(got: &[Top], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len(), "positions");
    got.iter()
        .zip(want)
        .flat_map(|(top, row)| top.iter().map(|&(t, lp)| (lp - row[t as usize]).abs()))
        .fold(0.0, f32::max)
}

/// Largest difference between two runs' top tokens where both list the token; the best
/// token must be the same.
fn run_gap(a: &[Top], b: &[Top]) -> f32 {
    assert_eq!(a.len(), b.len(), "positions");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x[0].0, y[0].0, "the best token differs between two runs");
            x.iter().filter_map(|&(t, lp)| {
                y.iter()
                    .find(|(u, _)| *u == t)
                    .map(|&(_, lq)| (lp - lq).abs())
            })
        })
        .fold(0.0, f32::max)
}

#[test]
fn every_architecture_matches_transformers_alone_and_in_a_batch() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let bf16_kernel = gantry_engine_native::cpu::matmul::has_bf16_kernel();
    println!(
        "bf16 weights: {}",
        if bf16_kernel {
            "the bf16 kernel (reference: bf16-rounded activations)"
        } else {
            "converted to f32 (reference: f32 activations)"
        }
    );
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for arch in ARCHS {
        for dtype in ["float32", "bfloat16"] {
            let name = format!("{arch}-{dtype}");
            let dir = root.join(&name);
            assert!(
                dir.join("reference.json").is_file(),
                "{} has no reference.json: run scripts/setup.sh",
                dir.display()
            );
            let r = read_reference(&dir, bf16_kernel);
            // A recurrent model verifies no drafts: its prompts go in one token per step alone
            // (every position compared) and whole in the batch (its chunked scan).
            let (feed_alone, feed_batched) = if RECURRENT.contains(&arch) {
                (Feed::OneByOne, Feed::Whole)
            } else {
                (Feed::Verify, Feed::Verify)
            };
            let plugin = plugin("native", 4, 128);
            let (shared, mut exec) = plugin
                .load_model(&st_desc(&name, &dir))
                .unwrap_or_else(|e| panic!("{name}: load: {e}"));
            assert_eq!(shared.info().architecture, r.class, "{name}");
            let n = r.prompts.len();
            let alone: Vec<Run> = (0..n)
                .flat_map(|i| {
                    run(
                        &mut exec,
                        &r.prompts[i..i + 1],
                        &r.greedy[i..i + 1],
                        &[0],
                        feed_alone,
                    )
                })
                .collect();
            // All prompts in one batch, the later ones joining while the first decodes.
            let join_at: Vec<usize> = (0..n).map(|i| i * 3).collect();
            let together = run(&mut exec, &r.prompts, &r.greedy, &join_at, feed_batched);
            let tol = tolerance(dtype);
            let (mut worst_prompt, mut worst_decode, mut batch_gap) = (0.0f32, 0.0f32, 0.0f32);
            let mut picked_same = 0;
            for i in 0..n {
                for (mode, got, feed) in [
                    ("alone", &alone[i], feed_alone),
                    ("batched", &together[i], feed_batched),
                ] {
                    let p = max_diff(&got.prompt, &feed.expected(&r.prompt_logprobs[i]));
                    let d = max_diff(&got.decode, &r.greedy_logprobs[i]);
                    worst_prompt = worst_prompt.max(p);
                    worst_decode = worst_decode.max(d);
                    if p > tol || d > tol {
                        failures.push(format!(
                            "{name} prompt {i} {mode}: max |Δ logprob| prompt {p:.2e}, decode {d:.2e} (bound {tol:.0e})"
                        ));
                    }
                    if dtype == "float32" && got.picked != r.greedy[i] {
                        failures.push(format!(
                            "{name} prompt {i} {mode}: greedy {:?}, transformers {:?}",
                            got.picked, r.greedy[i]
                        ));
                    }
                }
                batch_gap = batch_gap
                    .max(run_gap(
                        &feed_batched.expected(&alone[i].prompt),
                        &together[i].prompt,
                    ))
                    .max(run_gap(&alone[i].decode, &together[i].decode));
                picked_same += alone[i]
                    .picked
                    .iter()
                    .zip(&r.greedy[i])
                    .filter(|(a, b)| a == b)
                    .count();
            }
            if batch_gap > tol / 10.0 {
                failures.push(format!(
                    "{name}: batched and alone differ by {batch_gap:.2e} (bound {:.0e})",
                    tol / 10.0
                ));
            }
            report.push(format!(
                "{name:<20} {:<22} prompt {worst_prompt:.2e}  decode {worst_decode:.2e}  batch vs alone {batch_gap:.2e}  greedy {picked_same}/{}",
                r.class,
                n * r.greedy[0].len()
            ));
        }
    }
    println!("max |engine - transformers| log-probability, per checkpoint:");
    for line in &report {
        println!("  {line}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The largest |engine − reference| component over the embeddings of `prompts`, each engine
/// vector checked to be of unit length.
fn embedding_gap(exec: &mut ModelExec, prompts: &Value, embeddings: &Value, name: &str) -> f32 {
    let mut worst = 0.0f32;
    for (p, want) in prompts
        .as_array()
        .expect("prompts")
        .iter()
        .zip(embeddings.as_array().expect("embeddings"))
    {
        let got = exec.embed(&ints(p)).expect("embed");
        let want: Vec<f32> = want
            .as_array()
            .expect("a vector")
            .iter()
            .map(|x| x.as_f64().expect("a number") as f32)
            .collect();
        assert_eq!(got.len(), want.len(), "{name}");
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{name}: |v| = {norm}");
        worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(worst, f32::max);
    }
    worst
}

/// Embedding models (`BertModel`): the engine's pooled, normalised vector of each prompt
/// against transformers' `last_hidden_state`, mean-pooled and normalised as the checkpoint's
/// sentence-transformers `modules.json` declares.
#[test]
fn every_encoder_embeds_as_transformers_does() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let bf16_kernel = gantry_engine_native::cpu::matmul::has_bf16_kernel();
    for dtype in ["float32", "bfloat16"] {
        let name = format!("bert-{dtype}");
        let dir = root.join(&name);
        let path = dir.join("reference.json");
        let top: Value = serde_json::from_slice(
            &std::fs::read(&path)
                .unwrap_or_else(|e| panic!("{}: {e}: run scripts/setup.sh", path.display())),
        )
        .expect("reference.json");
        let v = match &top["bf16_activations"] {
            Value::Null => &top,
            r if bf16_kernel => r,
            _ => &top,
        };
        let plugin = plugin("native", 1, 64);
        let (shared, mut exec) = plugin
            .load_model(&st_desc(&name, &dir))
            .unwrap_or_else(|e| panic!("{name}: load: {e}"));
        let info = shared.info();
        assert!(
            info.supports_embedding() && !info.supports_completion(),
            "{name}: {info:?}"
        );
        assert_eq!(info.embedding_dims, 64, "{name}");
        let worst = embedding_gap(&mut exec, &top["prompts"], &v["embeddings"], &name);
        println!("{name}: max |engine - transformers| per component {worst:.2e}");
        let bound = if dtype == "float32" { 1e-5 } else { 1e-3 };
        assert!(worst < bound, "{name}: {worst:.2e} (bound {bound:.0e})");
        // Decoder calls are refused with the reason.
        let e = exec.seq_open().expect_err("an encoder has no sequences");
        assert!(e.message.contains("embedding model"), "{}", e.message);
    }
}

/// FP8 weights (`quant_method: fp8`, `float8_e4m3fn` in 32x32 blocks with `weight_scale_inv`):
/// the engine dequantizes them at load and then agrees with transformers run on the same
/// dequantized weights as closely as a bf16 checkpoint does; and it stays near the bf16
/// original the checkpoint was quantized from (what FP8's three mantissa bits cost a model
/// this small: measured up to 0.6 on the top-20 log-probabilities, bound 1.0).
#[test]
fn an_fp8_checkpoint_runs_as_its_dequantized_weights() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let bf16_kernel = gantry_engine_native::cpu::matmul::has_bf16_kernel();
    let dir = root.join("qwen3-fp8");
    let r = read_reference(&dir, bf16_kernel);
    let plugin = plugin("native", 4, 128);
    let (shared, mut exec) = plugin
        .load_model(&st_desc("qwen3-fp8", &dir))
        .unwrap_or_else(|e| panic!("qwen3-fp8: load: {e}"));
    assert_eq!(shared.info().architecture, r.class);
    let original = read_reference(&root.join("qwen3-bfloat16"), false);
    let (mut exact, mut near) = (0.0f32, 0.0f32);
    for i in 0..r.prompts.len() {
        let got = run(
            &mut exec,
            &r.prompts[i..i + 1],
            &r.greedy[i..i + 1],
            &[0],
            Feed::Verify,
        )
        .remove(0);
        exact = exact
            .max(max_diff(&got.prompt, &r.prompt_logprobs[i]))
            .max(max_diff(&got.decode, &r.greedy_logprobs[i]));
        near = near.max(max_diff(&got.prompt, &original.prompt_logprobs[i]));
    }
    println!(
        "qwen3-fp8: max |engine - transformers on the dequantized weights| {exact:.2e}; vs the bf16 original {near:.2e}"
    );
    assert!(exact < tolerance("bfloat16"), "{exact:.2e}");
    assert!(near < 1.0, "{near:.2e}");
}

/// Every family the llama.cpp plugin is checked on, by reference directory stem, with the
/// `general.architecture` llama.cpp's converter gives it: the float32 reference checkpoints
/// converted to GGUF by llama.cpp's own converter (`testkit/python/hf_to_gguf.py`). The first
/// eight are native-engine checkpoints too (`hf_reference.py`'s `LLAMA_CPP_SHARED`); the rest only
/// llama.cpp runs (`LLAMA_CPP_ONLY`). Left out: Qwen3-MoE with a dense layer among the sparse
/// ones (llama.cpp's `qwen3moe` takes none; `qwen3-moe-sparse` instead) and Mistral (llama.cpp
/// runs `MistralForCausalLM` as `llama`, without its `sliding_window`: on this checkpoint's
/// 8-token window it is wrong past position 8, 25 of 96 greedy tokens; Mistral releases without
/// a window are unaffected), and Llama 4 (llama.cpp aborts on the converted text model:
/// `GGML_ASSERT(buf != NULL && "tensor buffer not set")`). Where a family's released shapes
/// matter to llama.cpp, the checkpoint takes them (`hf_reference.py` says which and why). The
/// plugin's manifest lists exactly these architectures.
const LLAMA_CPP_FAMILIES: [(&str, &str); 49] = [
    ("llama", "llama"),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("gemma3", "gemma3"),
    ("mixtral", "llama"),
    ("qwen2-moe", "qwen2moe"),
    ("granite-hybrid", "granitehybrid"),
    ("granite-hybrid-dense", "granitehybrid"),
    ("gemma2", "gemma2"),
    ("olmo2", "olmo2"),
    ("starcoder2", "starcoder2"),
    ("granite", "granite"),
    ("stablelm", "stablelm"),
    ("gpt2", "gpt2"),
    ("gpt-bigcode", "starcoder"),
    ("gpt-neox", "gptneox"),
    ("falcon", "falcon"),
    ("bloom", "bloom"),
    ("phi2", "phi2"),
    ("phi3", "phi3"),
    ("gemma", "gemma"),
    ("olmo", "olmo"),
    ("olmoe", "olmoe"),
    ("cohere", "command-r"),
    ("cohere2", "cohere2"),
    ("granitemoe", "granitemoe"),
    ("nemotron", "nemotron"),
    ("deepseek2-lite", "deepseek2"),
    ("deepseek3", "deepseek2"),
    ("exaone4", "exaone4"),
    ("smollm3", "smollm3"),
    ("gpt-oss", "gpt-oss"),
    ("ernie4.5", "ernie4_5"),
    ("ernie4.5-moe", "ernie4_5-moe"),
    ("seed-oss", "seed_oss"),
    ("apertus", "apertus"),
    ("arcee", "arcee"),
    ("dots1", "dots1"),
    ("glm4", "glm4"),
    ("glm4-moe", "glm4moe"),
    ("dbrx", "dbrx"),
    ("hunyuan-dense", "hunyuan-dense"),
    ("qwen3-moe-sparse", "qwen3moe"),
    ("mamba", "mamba"),
    ("mamba2", "mamba2"),
    ("jamba", "jamba"),
    ("bamba-full-rope", "granitehybrid"),
    ("falcon-h1", "falcon-h1"),
    ("lfm2", "lfm2"),
];

/// The families with recurrent state (Mamba and short-convolution layers): their prompts go in
/// one token per step, since neither engine samples after every token of a recurrent batch.
const RECURRENT: [&str; 9] = [
    "mamba",
    "mamba2",
    "jamba",
    "bamba",
    "bamba-full-rope",
    "granite-hybrid",
    "granite-hybrid-dense",
    "falcon-h1",
    "lfm2",
];

/// The float32 checkpoint `name` and its GGUF as setup converted it, whose architecture must be
/// `arch`: (directory, GGUF path, GGUF header).
fn converted(
    root: &Path,
    name: &str,
    arch: &str,
) -> (
    std::path::PathBuf,
    std::path::PathBuf,
    gantry_formats::gguf::GgufHeader,
) {
    let dir = root.join(format!("{name}-float32"));
    let gguf = dir.join("model-f32.gguf");
    assert!(
        gguf.is_file(),
        "{} is missing: run scripts/setup.sh",
        gguf.display()
    );
    let header = gantry_formats::gguf::read_header(&gguf).expect("a GGUF header");
    assert_eq!(header.architecture(), Some(arch), "{name}");
    (dir, gguf, header)
}

/// Recurrent state per sequence of some of them, f32, from their configs: Mamba-2 (three
/// layers of (4 - 1) × (128 + 2 × 16) convolution inputs and 16 × 128 scan values), the
/// full-RoPE Bamba (two such layers), LFM2 (two short-convolution layers of (3 - 1) × 64).
const STATE_BYTES: [(&str, u64); 3] = [
    ("mamba2", 3 * (3 * 160 + 16 * 128) * 4),
    ("bamba-full-rope", 2 * (3 * 160 + 16 * 128) * 4),
    ("lfm2", 2 * (2 * 64) * 4),
];

/// The llama.cpp plugin against the same transformers answers: every position's top-20
/// log-probabilities and the greedy continuation (95 % of its tokens at least), each prompt
/// alone; then the plugin's manifest, which must list exactly the architectures checked here.
#[test]
fn the_llama_cpp_plugin_matches_transformers_on_the_converted_checkpoints() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for (name, gguf_arch) in LLAMA_CPP_FAMILIES {
        let (dir, gguf, header) = converted(&root, name, gguf_arch);
        eprintln!("llama.cpp plugin: {name} ({gguf_arch})");
        let r = read_reference(&dir, false);
        let plugin = plugin("llama_cpp", 4, 128);
        let mut exec = match plugin.load_model(&desc(
            name,
            &dir,
            &gguf,
            gantry_engine_abi::Format::Gguf,
        )) {
            Ok((shared, exec)) => {
                // Recurrent state (ABI 1.7) exactly where the family keeps one.
                let state = shared.info().recurrent_state_bytes;
                if (state > 0) != RECURRENT.contains(&name) {
                    failures.push(format!(
                        "{name}: recurrent state {state} bytes per sequence"
                    ));
                }
                if let Some(&(_, want)) = STATE_BYTES.iter().find(|(n, _)| *n == name)
                    && state != want
                {
                    failures.push(format!(
                            "{name}: recurrent state {state} bytes per sequence, llama.cpp's layout gives {want}"
                        ));
                }
                exec
            }
            Err(e) => {
                failures.push(format!("{name}: load: {e}"));
                continue;
            }
        };
        let (mut worst, mut picked_same) = (0.0f32, 0);
        for i in 0..r.prompts.len() {
            let got = run(
                &mut exec,
                &r.prompts[i..i + 1],
                &r.greedy[i..i + 1],
                &[0],
                if RECURRENT.contains(&name) {
                    Feed::OneByOne
                } else {
                    Feed::Verify
                },
            )
            .remove(0);
            worst = worst
                .max(max_diff(&got.prompt, &r.prompt_logprobs[i]))
                .max(max_diff(&got.decode, &r.greedy_logprobs[i]));
            picked_same += got
                .picked
                .iter()
                .zip(&r.greedy[i])
                .filter(|(a, b)| a == b)
                .count();
        }
        let total = r.prompts.len() * r.greedy[0].len();
        let bound = llama_cpp_tolerance(&header, gguf_arch);
        if worst > bound || picked_same * 100 < total * 95 {
            failures.push(format!(
                "{name}: max |Δ logprob| {worst:.2e} (bound {bound:.1e}), greedy {picked_same}/{total} (at least 95 %)"
            ));
        }
        report.push(format!(
            "{name:<16} {gguf_arch:<14} {:<30} {worst:.2e} (bound {bound:.1e})  greedy {picked_same}/{total}",
            r.class
        ));
    }
    println!("llama.cpp plugin, max |engine - transformers| log-probability:");
    for line in &report {
        println!("  {line}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    let manifest: Value = serde_json::from_str(include_str!("../../llama-cpp/manifest.json"))
        .expect("the llama.cpp manifest parses");
    let listed: std::collections::BTreeSet<&str> = manifest["architectures"]
        .as_array()
        .expect("architectures")
        .iter()
        .map(|v| v.as_str().expect("a name"))
        .collect();
    let checked: std::collections::BTreeSet<&str> = LLAMA_CPP_FAMILIES
        .iter()
        .chain([&LLAMA_CPP_ENCODER])
        .map(|(_, arch)| *arch)
        .collect();
    assert_eq!(
        listed, checked,
        "engines/llama-cpp/manifest.json must list exactly the architectures checked here"
    );
}

/// llama.cpp computes an f32 model's products in f32 but keeps its KV cache in f16, which is
/// most of the gap, and the rounding adds up layer after layer: the bound is 5e-2 for up to six
/// layers and grows with depth beyond (measured: 7.7e-4 to 4.3e-2 on three to six layers,
/// DBRX the largest; 1.7e-1 on DeepSeek-V2-Lite's 27, whose cache holds the compressed
/// latent). Greedy tokens may then part at near-ties.
fn llama_cpp_tolerance(header: &gantry_formats::gguf::GgufHeader, arch: &str) -> f32 {
    let blocks = header
        .metadata
        .get(&format!("{arch}.block_count"))
        .and_then(|v| v.as_u64())
        .expect("block_count");
    5e-2 * (blocks as f32 / 6.0).max(1.0)
}

/// The encoder the llama.cpp plugin is checked on (stem, GGUF architecture); in its manifest
/// with the decoder families.
const LLAMA_CPP_ENCODER: (&str, &str) = ("bert", "bert");

/// The tiny BertModel (`hf_reference.py`'s `ENCODERS`, float32) converted by llama.cpp's
/// converter: the llama.cpp plugin's embeddings (llama.cpp pools as the GGUF says: mean, then
/// the plugin scales to unit length) against transformers' mean-pooled, normalised
/// `last_hidden_state` (measured: 9.3e-5 per component at most; llama.cpp runs BERT without a
/// KV cache, in f32).
#[test]
fn the_llama_cpp_plugin_embeds_the_converted_encoder_as_transformers_does() {
    let root = env_path("GANTRY_HF_REFERENCE");
    let (stem, arch) = LLAMA_CPP_ENCODER;
    let (dir, gguf, _) = converted(&root, stem, arch);
    let top: Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).expect("reference"))
            .expect("reference.json");
    let plugin = plugin("llama_cpp", 1, 64);
    let (shared, mut exec) = plugin
        .load_model(&desc(stem, &dir, &gguf, gantry_engine_abi::Format::Gguf))
        .expect("load");
    let info = shared.info();
    assert!(info.supports_embedding(), "{info:?}");
    assert_eq!(info.embedding_dims, 64);
    let worst = embedding_gap(&mut exec, &top["prompts"], &top["embeddings"], stem);
    println!("bert (llama.cpp plugin): max |engine - transformers| per component {worst:.2e}");
    assert!(worst < 1e-3, "{worst:.2e} (bound 1e-3)");
}
