//! Prefix reuse in the native engine (KV bookkeeping, below the scheduler): a prompt that
//! repeats a cached one takes its full blocks, one that diverges copies the matching head of
//! the block where it diverges, and neither changes the output.
//!
//! The plugin's debug lines are read through a thread-local `tracing` subscriber, so this test
//! has a binary of its own: nothing else in the process installs a subscriber meanwhile.

mod common;

use std::sync::Arc;

use common::*;
use gantry_testkit::hf::{HfFamily, write_tiny_hf};

/// The tests of this binary run one at a time: a test running beside the capture, on a thread
/// without a subscriber, can register the plugin's log callsites as never enabled between the
/// capture's interest rebuild and its first line, and the capture then reads nothing.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` and returns its result with the plugin's log lines meanwhile (the engine host
/// forwards them to `tracing` on the calling thread).
fn with_plugin_log<T>(f: impl FnOnce() -> T) -> (T, String) {
    #[derive(Clone, Default)]
    struct Capture(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log buffer").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Capture::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let out = tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let log = String::from_utf8_lossy(&buf.0.lock().expect("log buffer")).into_owned();
    (out, log)
}

/// The `(reused, evaluated)` counts of the engine's first-chunk lines in `log`.
fn reuse_counts(log: &str) -> Vec<(usize, usize)> {
    log.lines()
        .filter_map(|l| {
            let rest = l.split(" tokens, ").nth(1)?;
            let (reused, rest) = rest.split_once(" reused from the prefix cache, ")?;
            let evaluated = rest.split_once(" evaluated")?.0;
            Some((reused.parse().ok()?, evaluated.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_cached_prefix_is_reused_by_blocks_and_copied_where_prompts_diverge_without_changing_the_output()
 {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), HfFamily::Llama, 0).expect("write");
    let native = plugin("native", 4, 256);
    let text = "Question: what is the capital of France? The capital of France is Paris, and \
                the capital of the world is a city with one name.";
    let (s, mut warm) = native
        .load_model(&st_desc("warm", dir.path()))
        .expect("load");
    let p = s.tokenize(text, true, false).expect("tok");
    assert!(
        p.len() > 2 * 16,
        "{} tokens: the prompt must span several blocks",
        p.len()
    );
    // Same prompt again: every full block but the one holding the last token (whose logits
    // are needed) is shared; that one is copied up to the last token.
    let ((first, second), log) = with_plugin_log(|| {
        let a = generate(&mut warm, std::slice::from_ref(&p), 10, &[]).remove(0);
        let b = generate(&mut warm, std::slice::from_ref(&p), 10, &[]).remove(0);
        (a, b)
    });
    assert_eq!(first, second, "reuse changed the continuation");
    let counts = reuse_counts(&log);
    assert_eq!(counts.len(), 2, "{log}");
    assert_eq!(counts[0], (0, p.len()), "a cold cache reuses nothing");
    assert_eq!(
        counts[1],
        (p.len() - 1, 1),
        "the repeat evaluates only its last token"
    );

    // A prompt that differs 5 tokens from the end: reused up to the difference, exact output.
    let mut q = p.clone();
    let k = q.len() - 5;
    q[k] = s.tokenize("world", false, false).expect("t")[0];
    let (cached, log) =
        with_plugin_log(|| generate(&mut warm, std::slice::from_ref(&q), 10, &[]).remove(0));
    assert_eq!(reuse_counts(&log), vec![(k, q.len() - k)], "{log}");
    let (_cold_s, mut cold) = native
        .load_model(&st_desc("cold", dir.path()))
        .expect("load");
    let fresh = generate(&mut cold, std::slice::from_ref(&q), 10, &[]).remove(0);
    assert_eq!(cached, fresh, "a reused prefix changed the continuation");
}

#[test]
fn the_engine_reports_the_positions_its_shared_prefix_blocks_cover() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    use gantry_engine_abi::{Sampling, StepEntry};
    use gantry_engine_native::BLOCK_SIZE;

    let dir = tempfile::tempdir().expect("tempdir");
    write_tiny_hf(dir.path(), HfFamily::Llama, 0).expect("write");
    let native = plugin("native", 4, 256);
    let (s, mut exec) = native
        .load_model(&st_desc("tiny", dir.path()))
        .expect("load");
    let text = "Question: what is the capital of France? The capital of France is Paris, and \
                the capital of the world is a city with one name. Question: and of Italy? \
                Rome, a city on seven hills, is the capital of Italy.";
    let p = s.tokenize(text, true, false).expect("tok");
    assert!(
        p.len() > 4 * BLOCK_SIZE,
        "{} tokens: the prompt must span several blocks",
        p.len()
    );
    // `seq_cached_tokens` (ABI 1.4) for a new sequence whose first entry is `prompt`, stepped
    // once; releasing it leaves its blocks cached for the next.
    let greedy = Sampling::greedy();
    let mut cached = |prompt: &[i32]| {
        let seq = exec.seq_open().expect("seq_open");
        exec.step(&[StepEntry {
            seq,
            tokens: prompt,
            sample: Some(&greedy),
            fresh: false,
            allowed: None,
            sample_all: false,
        }])
        .expect("step");
        let n = exec.seq_cached_tokens(seq);
        exec.seq_release(seq);
        n
    };
    // `p` with a different token at position `k`: it shares exactly its first `k` tokens.
    let diverging_at = |k: usize| {
        let mut q = p.clone();
        q[k] = if q[k] == 5 { 6 } else { 5 };
        q
    };
    assert_eq!(cached(&p), Some(0), "a cold cache covers nothing");
    assert_eq!(
        cached(&p),
        Some(p.len() as u64 - 1),
        "a repeat: every block up to the last token, whose logits are needed"
    );
    assert_eq!(
        cached(&diverging_at(3 * BLOCK_SIZE)),
        Some(3 * BLOCK_SIZE as u64),
        "three shared blocks, and nothing of the fourth to copy"
    );
    assert_eq!(
        cached(&diverging_at(2 * BLOCK_SIZE + 5)),
        Some(2 * BLOCK_SIZE as u64 + 5),
        "two shared blocks and the first 5 positions of the third, copied"
    );
}
