//! What a llama.cpp step costs by the tokens it carries (outside the request path: a
//! measurement tool). Decodes a 200-token prompt, then times `llama_decode` of 1..=16 tokens
//! of one sequence, logits at every token as a verification step asks (`ALL=0`: at the last
//! only), and prints the best and mean of 30 runs per size. The numbers behind speculative
//! decoding's adaptive draft lengths (`scheduler/src/draft_len.rs`, docs/benchmarks.md).
//!
//! `cargo run --release -p gantry-engine-llama-cpp --example batch_cost -- MODEL.gguf [THREADS]`
use std::num::NonZeroU32;
use std::time::Instant;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::token::LlamaToken;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: batch_cost MODEL.gguf [THREADS]")?;
    let threads: i32 = args.next().map_or(Ok(2), |s| s.parse())?;
    let all_logits = std::env::var("ALL").map_or(true, |v| v != "0");
    let mut backend = LlamaBackend::init()?;
    backend.void_logs();
    let model = LlamaModel::load_from_file(&backend, &path, &LlamaModelParams::default())?;
    let cp = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(4096))
        .with_n_batch(2048)
        .with_n_ubatch(512)
        .with_n_threads(threads)
        .with_n_threads_batch(threads)
        .with_no_perf(true);
    let mut ctx = model.new_context(&backend, cp)?;
    let mut batch = LlamaBatch::new(512, 1);
    let prompt: Vec<i32> = (0..200).map(|i| 1000 + (i * 37) % 5000).collect();
    for (i, &t) in prompt.iter().enumerate() {
        batch.add(LlamaToken(t), i as i32, &[0], i + 1 == prompt.len())?;
    }
    ctx.decode(&mut batch)?;
    let base = prompt.len() as i32;
    let (warm, reps) = (3, 30);
    for n in 1usize..=16 {
        let (mut best, mut sum) = (f64::MAX, 0.0);
        for r in 0..warm + reps {
            batch.clear();
            for i in 0..n {
                let want = all_logits || i + 1 == n;
                batch.add(LlamaToken(2000 + i as i32), base + i as i32, &[0], want)?;
            }
            let t0 = Instant::now();
            ctx.decode(&mut batch)?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            ctx.clear_kv_cache_seq(Some(0), Some(base as u32), None)?;
            if r >= warm {
                best = best.min(ms);
                sum += ms;
            }
        }
        println!("n={n} best {best:.2} ms mean {:.2} ms", sum / reps as f64);
    }
    Ok(())
}
