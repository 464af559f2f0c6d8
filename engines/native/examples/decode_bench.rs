//! The native engine's decode benchmark at the engine level (the GPU benchmark's `native`
//! side, beside `bench/torch_decode.py`): the engine's own `step` loop, without the node's
//! HTTP, so it compares with a plain framework loop on the same shapes.
//!
//! ```text
//! decode_bench write --shape gemma3-270m|llama3-8b DIR
//!     a checkpoint of that shape with random bf16 weights (config.json, model.safetensors,
//!     a word-level tokenizer.json): no download, the same shapes as the real models
//! decode_bench run --model DIR [--backend cuda|cpu] [--batches 1,8,64,256] [--prompt 128]
//!     [--gen 128] [--chunk 2048] [--greedy] [--label native] --out FILE.json
//! ```
//!
//! `run` opens `batch` sequences, feeds each a random prompt of `--prompt` tokens in steps of
//! at most `--chunk` tokens (time to first token: when the step holding a sequence's last
//! prompt token returns), then decodes `--gen` tokens for all of them, one step per token
//! (inter-token time: each step's wall time). Sampling is temperature 1 with a seed per
//! sequence (or greedy), on the device where the backend samples there. A few warm-up steps at
//! each batch size come first (the CUDA backend captures its decode graph on the second).
//! Writes JSON after every batch size.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use gantry_engine_abi::sdk::{Engine, HostLog, Model};
use gantry_engine_abi::{
    Backend as AbiBackend, EngineConfig, Format, ModelDescriptor, Sampling, StepEntry,
};
use gantry_engine_native::NativeEngine;
use rayon::prelude::*;
use serde_json::{Value, json};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("write") => {
            let shape = arg(&args, "--shape").unwrap_or_else(|| "gemma3-270m".into());
            let dir = args.last().map(PathBuf::from).expect("DIR");
            write_checkpoint(&shape, &dir)
        }
        Some("run") => run(&args),
        _ => Err("usage: decode_bench write --shape S DIR | run --model DIR --out FILE ...".into()),
    };
    if let Err(e) = result {
        eprintln!("decode_bench: {e}");
        std::process::exit(1);
    }
}

/// config.json of a shape, and whether its norms are (1 + w) (Gemma) or w.
fn shape_config(shape: &str) -> Result<(Value, bool), String> {
    match shape {
        "gemma3-270m" => {
            let layer_types: Vec<&str> = (0..18)
                .map(|i| {
                    if i % 6 == 5 {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                })
                .collect();
            Ok((
                json!({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640,
                "intermediate_size": 2048, "layer_types": layer_types,
                "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 18,
                "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
                "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "sliding_window": 512,
                "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 262144,
                "bos_token_id": 2, "eos_token_id": [1, 106]}),
                true,
            ))
        }
        "llama3-8b" => Ok((
            json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "vocab_size": 128256, "bos_token_id": 1,
            "eos_token_id": 2}),
            false,
        )),
        other => Err(format!("unknown shape {other} (gemma3-270m, llama3-8b)")),
    }
}

/// The tensors of a Llama/Gemma 3 checkpoint: (name, shape, is a norm).
fn tensors(c: &Value) -> Vec<(String, Vec<usize>, bool)> {
    let u = |k: &str| c[k].as_u64().expect(k) as usize;
    let (h, ff, layers, vocab) = (
        u("hidden_size"),
        u("intermediate_size"),
        u("num_hidden_layers"),
        u("vocab_size"),
    );
    let hd = c["head_dim"]
        .as_u64()
        .map_or(h / u("num_attention_heads"), |v| v as usize);
    let (q, kv) = (u("num_attention_heads") * hd, u("num_key_value_heads") * hd);
    let gemma = c["model_type"] == "gemma3_text";
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![vocab, h],
        false,
    )];
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        let mut add = |n: &str, s: Vec<usize>, norm: bool| t.push((format!("{p}.{n}"), s, norm));
        add("input_layernorm.weight", vec![h], true);
        add("self_attn.q_proj.weight", vec![q, h], false);
        add("self_attn.k_proj.weight", vec![kv, h], false);
        add("self_attn.v_proj.weight", vec![kv, h], false);
        add("self_attn.o_proj.weight", vec![h, q], false);
        add("post_attention_layernorm.weight", vec![h], true);
        if gemma {
            add("self_attn.q_norm.weight", vec![hd], true);
            add("self_attn.k_norm.weight", vec![hd], true);
            add("pre_feedforward_layernorm.weight", vec![h], true);
            add("post_feedforward_layernorm.weight", vec![h], true);
        }
        add("mlp.gate_proj.weight", vec![ff, h], false);
        add("mlp.up_proj.weight", vec![ff, h], false);
        add("mlp.down_proj.weight", vec![h, ff], false);
    }
    t.push(("model.norm.weight".to_string(), vec![h], true));
    if !c["tie_word_embeddings"].as_bool().unwrap_or(false) {
        t.push(("lm_head.weight".to_string(), vec![vocab, h], false));
    }
    t
}

/// bf16 bits of uniform values in [-a, a] (+ mean), from a counter-based hash: any chunk is
/// made on its own, so chunks are made in parallel.
fn fill(out: &mut [u8], seed: u64, start: u64, a: f32, mean: f32) {
    out.par_chunks_mut(2 << 16)
        .enumerate()
        .for_each(|(ci, chunk)| {
            for (j, b) in chunk.chunks_exact_mut(2).enumerate() {
                let mut x = seed
                    ^ (start + (ci as u64) * 65536 + j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                x ^= x >> 33;
                x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
                x ^= x >> 33;
                let u = (x >> 40) as f32 / (1u64 << 24) as f32;
                let v = mean + a * (2.0 * u - 1.0);
                b.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }
        });
}

fn write_checkpoint(shape: &str, dir: &Path) -> Result<(), String> {
    let (config, gemma) = shape_config(shape)?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let w = |name: &str, v: &Value| {
        std::fs::write(dir.join(name), serde_json::to_vec_pretty(v).expect("json"))
            .map_err(|e| e.to_string())
    };
    w("config.json", &config)?;
    // A word-level tokenizer of a few hundred words: the benchmark feeds token ids.
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<eos>", "<bos>"].iter().enumerate() {
        vocab.insert((*t).to_string(), json!(i));
    }
    for i in 3..512 {
        vocab.insert(format!("w{i}"), json!(i));
    }
    w(
        "tokenizer.json",
        &json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}),
    )?;
    w(
        "tokenizer_config.json",
        &json!({"bos_token": "<bos>", "eos_token": "<eos>"}),
    )?;
    let list = tensors(&config);
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for (name, shape, _) in &list {
        let n: usize = shape.iter().product();
        header.insert(
            name.clone(),
            json!({"dtype": "BF16", "shape": shape, "data_offsets": [off, off + 2 * n as u64]}),
        );
        off += 2 * n as u64;
    }
    let mut hbytes = serde_json::to_vec(&Value::Object(header)).map_err(|e| e.to_string())?;
    while hbytes.len() % 8 != 0 {
        hbytes.push(b' ');
    }
    let file = std::fs::File::create(dir.join("model.safetensors")).map_err(|e| e.to_string())?;
    let mut f = BufWriter::with_capacity(1 << 22, file);
    f.write_all(&(hbytes.len() as u64).to_le_bytes())
        .and_then(|_| f.write_all(&hbytes))
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 64 << 20];
    let mut at = 0u64;
    for (i, (_, shape, norm)) in list.iter().enumerate() {
        let mut left = 2 * shape.iter().product::<usize>();
        let cols = *shape.last().expect("shape") as f32;
        let (a, mean) = match (norm, gemma) {
            (true, true) => (0.1, 0.0),
            (true, false) => (0.1, 1.0),
            (false, _) => (1.7 / cols.sqrt(), 0.0),
        };
        while left > 0 {
            let n = left.min(buf.len());
            fill(&mut buf[..n], i as u64 + 1, at, a, mean);
            f.write_all(&buf[..n]).map_err(|e| e.to_string())?;
            at += n as u64 / 2;
            left -= n;
        }
    }
    f.flush().map_err(|e| e.to_string())?;
    eprintln!(
        "decode_bench: wrote {shape} to {} ({off} bytes of weights)",
        dir.display()
    );
    Ok(())
}

fn pct(xs: &mut [f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    xs[((p / 100.0) * (xs.len() - 1) as f64).round() as usize]
}

fn run(args: &[String]) -> Result<(), String> {
    let model_dir = PathBuf::from(arg(args, "--model").ok_or("--model DIR")?);
    let out = PathBuf::from(arg(args, "--out").ok_or("--out FILE")?);
    let backend = match arg(args, "--backend").as_deref() {
        Some("cpu") => AbiBackend::Cpu,
        _ => AbiBackend::Cuda,
    };
    let num = |k: &str, d: usize| {
        arg(args, k).map_or(Ok(d), |v| v.parse().map_err(|e| format!("{k}: {e}")))
    };
    let batches: Vec<usize> = arg(args, "--batches")
        .unwrap_or_else(|| "1,8,64,256".into())
        .split(',')
        .map(|s| s.parse().map_err(|e| format!("--batches: {e}")))
        .collect::<Result<_, String>>()?;
    let (prompt, n_gen, chunk) = (
        num("--prompt", 128)?,
        num("--gen", 128)?,
        num("--chunk", 2048)?,
    );
    let greedy = args.iter().any(|a| a == "--greedy");
    let label = arg(args, "--label").unwrap_or_else(|| "native".into());
    let max_batch = *batches.iter().max().ok_or("no batch sizes")?;
    let engine = NativeEngine::create(
        EngineConfig {
            backend,
            max_batch_size: max_batch as u32,
            context_length: (prompt + n_gen + 64) as u32,
            ..EngineConfig::default()
        },
        HostLog::discard(),
    )
    .map_err(|e| e.message)?;
    let t0 = Instant::now();
    let model = engine
        .load_model(&ModelDescriptor::new(
            "bench",
            model_dir.join("model.safetensors"),
            Format::Safetensors,
        ))
        .map_err(|e| e.message)?;
    let load_s = t0.elapsed().as_secs_f64();
    let info = model.info();
    let vocab = info.vocab_size as i32;
    let mut report = json!({"benchmark": "decode_bench", "label": label,
        "backend": format!("{backend:?}"), "model": model_dir.display().to_string(),
        "prompt": prompt, "gen": n_gen, "chunk": chunk,
        "sampling": if greedy { "greedy" } else { "temperature 1.0, seeded per sequence" },
        "load_s": load_s, "bytes_used": info.bytes_used, "rows": []});
    for &batch in &batches {
        let row = match one_batch(&model, batch, prompt, n_gen, chunk, greedy, vocab) {
            Ok(r) => r,
            Err(e) => json!({"batch": batch, "error": e}),
        };
        eprintln!("decode_bench {label} batch {batch}: {row}");
        report["rows"].as_array_mut().expect("rows").push(row);
        std::fs::write(&out, serde_json::to_vec_pretty(&report).expect("json"))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn one_batch(
    model: &impl Model,
    batch: usize,
    prompt: usize,
    n_gen: usize,
    chunk: usize,
    greedy: bool,
    vocab: i32,
) -> Result<Value, String> {
    let e = |e: gantry_engine_abi::EngineError| e.message;
    let params: Vec<Sampling> = (0..batch)
        .map(|i| {
            if greedy {
                Sampling::greedy()
            } else {
                Sampling {
                    temperature: 1.0,
                    seed: 1000 + i as u64,
                    ..Sampling::greedy()
                }
            }
        })
        .collect();
    let prompts: Vec<Vec<i32>> = (0..batch)
        .map(|i| {
            (0..prompt)
                .map(|j| 3 + ((i * 7919 + j * 104_729) as i32).rem_euclid(vocab - 3))
                .collect()
        })
        .collect();
    // Warm-up: a short prompt and three decode steps at this batch size (eager, capture,
    // replay), then the measured run on fresh sequences.
    for (run, (p_len, steps)) in [(8usize, 3usize), (prompt, n_gen)].into_iter().enumerate() {
        let warm = run == 0;
        let seqs: Vec<u64> = (0..batch)
            .map(|_| model.seq_open())
            .collect::<Result<_, _>>()
            .map_err(e)?;
        let t0 = Instant::now();
        let mut ttft = Vec::with_capacity(batch);
        let mut last = vec![0i32; batch];
        // Prompts in steps of at most `chunk` tokens, in order.
        let mut i = 0;
        let mut done = vec![0usize; batch];
        while i < batch {
            let mut entries = Vec::new();
            let mut budget = chunk;
            let mut j = i;
            while j < batch && budget > 0 {
                let take = (p_len - done[j]).min(budget);
                let fin = done[j] + take == p_len;
                entries.push((j, done[j], take, fin));
                budget -= take;
                if !fin {
                    break;
                }
                j += 1;
            }
            let steps_in: Vec<StepEntry<'_>> = entries
                .iter()
                .map(|&(j, from, take, fin)| StepEntry {
                    seq: seqs[j],
                    tokens: &prompts[j][from..from + take],
                    sample: fin.then_some(&params[j]),
                    fresh: true,
                    allowed: None,
                    sample_all: false,
                })
                .collect();
            let r = model.step(&steps_in).map_err(e)?;
            let now = t0.elapsed().as_secs_f64() * 1000.0;
            for (&(j, _, take, fin), s) in entries.iter().zip(r) {
                done[j] += take;
                if fin {
                    ttft.push(now);
                    last[j] = s.ok_or("no sample on a last prompt chunk")?.token;
                    i = j + 1;
                }
            }
        }
        let mut step_ms = Vec::with_capacity(steps);
        let d0 = Instant::now();
        for _ in 0..steps {
            let feed: Vec<[i32; 1]> = last.iter().map(|&t| [t]).collect();
            let entries: Vec<StepEntry<'_>> = (0..batch)
                .map(|j| StepEntry {
                    seq: seqs[j],
                    tokens: &feed[j],
                    sample: Some(&params[j]),
                    fresh: false,
                    allowed: None,
                    sample_all: false,
                })
                .collect();
            let s0 = Instant::now();
            let r = model.step(&entries).map_err(e)?;
            step_ms.push(s0.elapsed().as_secs_f64() * 1000.0);
            for (j, s) in r.into_iter().enumerate() {
                last[j] = s.ok_or("no sample")?.token;
            }
        }
        let decode_s = d0.elapsed().as_secs_f64();
        for s in seqs {
            model.seq_release(s);
        }
        if warm {
            continue;
        }
        let tps = (batch * steps) as f64 / decode_s;
        return Ok(json!({"batch": batch, "aggregate_tps": tps,
            "ms_per_step": decode_s * 1000.0 / steps as f64,
            "step_ms_p50": pct(&mut step_ms.clone(), 50.0), "step_ms_p99": pct(&mut step_ms, 99.0),
            "ttft_ms_p50": pct(&mut ttft.clone(), 50.0), "ttft_ms_p99": pct(&mut ttft, 99.0),
            "error": null}));
    }
    Err("no measured run".into())
}
