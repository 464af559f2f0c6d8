//! Open-loop HTTP load generator for the gateway-overhead benchmark (outside any request path:
//! it is the client). Sends one fixed POST at a fixed rate for a bounded time and prints latency
//! percentiles as JSON.
//!
//! Open loop: request `i` is due at `start + i / rate` whether or not earlier ones have
//! answered, and its latency is measured from that due time, so a stall shows up in the tail
//! instead of silently lowering the rate (no coordinated omission).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;

#[derive(Parser)]
#[command(about = "Open-loop POST load at a fixed rate; prints latency percentiles as JSON")]
struct Args {
    /// Full URL to POST to.
    #[arg(long)]
    url: String,
    /// JSON request body.
    #[arg(long)]
    body: String,
    /// Requests per second.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// Measured seconds (bounded: at most 120).
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Unmeasured seconds at the same rate first (connection pool and caches warm).
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Label copied into the output.
    #[arg(long, default_value = "")]
    label: String,
    /// Also write every measured latency (microseconds, one per line) to this file, so that
    /// several short runs can be pooled.
    #[arg(long)]
    raw: Option<std::path::PathBuf>,
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if args.duration == 0 || args.duration > 120 || args.warmup > 60 || args.rate == 0 {
        bail!("--duration must be 1..=120 s, --warmup <= 60 s, --rate > 0");
    }
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(60))
        .timeout(Duration::from_secs(10))
        .build()
        .context("client")?;
    let body = bytes::Bytes::from(args.body.clone());
    let interval = Duration::from_secs_f64(1.0 / f64::from(args.rate));
    let warm_n = args.warmup * u64::from(args.rate);
    let total = warm_n + args.duration * u64::from(args.rate);
    let start = Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let due = start + interval.mul_f64(i as f64);
        tokio::time::sleep_until(due.into()).await;
        let (client, body, url) = (client.clone(), body.clone(), args.url.clone());
        tasks.push(tokio::spawn(async move {
            let ok = match client
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
            {
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                Err(_) => false,
            };
            (i, ok, due.elapsed())
        }));
    }
    let sent_secs = start.elapsed().as_secs_f64();
    let mut lat = Vec::with_capacity(total as usize);
    let mut errors = 0u64;
    for t in tasks {
        let (i, ok, took) = t.await.context("request task")?;
        if i < warm_n {
            continue;
        }
        if ok {
            lat.push(took.as_micros() as u64);
        } else {
            errors += 1;
        }
    }
    lat.sort_unstable();
    if let Some(path) = &args.raw {
        let text: String = lat.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let us = |p| percentile(&lat, p);
    let out = serde_json::json!({
        "label": args.label,
        "url": args.url,
        "rate": args.rate,
        "duration_s": args.duration,
        "achieved_send_rate": total as f64 / sent_secs,
        "ok": lat.len(),
        "errors": errors,
        "latency_us": {"p50": us(50.0), "p90": us(90.0), "p99": us(99.0), "p99_9": us(99.9),
                        "max": lat.last().copied().unwrap_or(0),
                        "mean": lat.iter().sum::<u64>() as f64 / lat.len().max(1) as f64},
    });
    println!("{out}");
    Ok(())
}
