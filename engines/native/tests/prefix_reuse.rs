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
