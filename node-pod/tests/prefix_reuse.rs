//! Prefix reuse in the llama.cpp plugin (engine layer, below the scheduler): a released
//! sequence's prompt cells serve the next prompt that shares its prefix, without changing the
//! output.
//!
//! The first test reads the plugin's debug lines through a thread-local `tracing` subscriber, so
//! the tests of this binary run one at a time ([`serial`]): no other test registers callsites or
//! logs from the plugin while it captures.

mod common;

use std::sync::Arc;

use common::*;
use gantry_node::engine_host::ModelShared;
use gantry_testkit::TinyModelSpec;

/// Runs `f` and returns what it returned with the plugin's debug lines logged meanwhile (the
/// engine host forwards them to `tracing` on the calling thread).
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
    // Recompute every callsite's interest with this subscriber installed: a test on another
    // thread may have cached "never" for the plugin's debug callsite under a quieter subscriber.
    let out = tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let log = String::from_utf8_lossy(&buf.0.lock().expect("log buffer")).into_owned();
    (out, log)
}

/// The `(reused, evaluated)` counts of the engine's prefix-reuse lines in `log`.
fn reuse_counts(log: &str) -> Vec<(usize, usize)> {
    log.lines()
        .filter_map(|l| {
            let rest = l.split(" tokens, ").nth(1)?;
            let (reused, rest) = rest.split_once(" reused from a warm slot, ")?;
            let evaluated = rest.split_once(" evaluated")?.0;
            Some((reused.parse().ok()?, evaluated.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_released_prompt_prefix_is_reused_without_changing_the_output() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 512);
    let prompt = |tail: &str, s: &ModelShared| {
        s.tokenize(
            &format!("A long shared system prompt about Paris and France. {tail}"),
            true,
            false,
        )
        .expect("tok")
    };
    // Cold: a fresh model answers both prompts.
    let (cold_s, mut cold) = plugin.load_model(&desc("cold", &path)).expect("load");
    let a = prompt("First question?", &cold_s);
    let b = prompt("Second one!", &cold_s);
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(shared > 4, "the prompts share a prefix: {a:?} {b:?}");
    let (a_cold, log) =
        with_plugin_log(|| generate_batched(&mut cold, std::slice::from_ref(&a), 16).remove(0));
    assert_eq!(
        reuse_counts(&log),
        vec![(0, a.len())],
        "a cold model evaluates the whole prompt"
    );
    let (fresh_s, mut fresh) = plugin.load_model(&desc("fresh", &path)).expect("load");
    let b_cold = generate_batched(&mut fresh, &[prompt("Second one!", &fresh_s)], 16).remove(0);
    // Warm: B runs right after A was released on the same model, sharing A's prefix cells.
    let (b_warm, log) =
        with_plugin_log(|| generate_batched(&mut cold, std::slice::from_ref(&b), 16).remove(0));
    assert_eq!(
        reuse_counts(&log),
        vec![(shared, b.len() - shared)],
        "B evaluates only what follows the prefix it shares with A"
    );
    assert_eq!(b_warm, b_cold, "prefix reuse changed the answer");
    // The same prompt again: all of it is cached but the last token, which is evaluated again
    // for its logits.
    let (b_again, log) =
        with_plugin_log(|| generate_batched(&mut cold, std::slice::from_ref(&b), 16).remove(0));
    assert_eq!(reuse_counts(&log), vec![(b.len() - 1, 1)]);
    assert_eq!(b_again, b_cold);
    // And A once more, on the cells B left: the shared prefix again.
    let (a_again, log) =
        with_plugin_log(|| generate_batched(&mut cold, std::slice::from_ref(&a), 16).remove(0));
    assert_eq!(reuse_counts(&log), vec![(shared, a.len() - shared)]);
    assert_eq!(a_again, a_cold);
}

#[test]
fn the_plugin_reports_the_prefix_it_took_from_a_warm_slot() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 512);
    let (s, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let text = |tail: &str| format!("A long shared system prompt about Paris and France. {tail}");
    let a = s
        .tokenize(&text("First question?"), true, false)
        .expect("tok");
    let b = s.tokenize(&text("Second one!"), true, false).expect("tok");
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    // `seq_cached_tokens` (ABI 1.4) for a new sequence whose first entry is `prompt`; the
    // sequence is then released, its cells staying warm for the next.
    let mut cached = |prompt: &[i32], fresh: bool| {
        let (seq, _) = step_new_sequence(&mut exec, prompt, fresh);
        let n = exec.seq_cached_tokens(seq);
        exec.seq_release(seq);
        n
    };
    assert_eq!(cached(&a, false), Some(0), "a cold model takes nothing");
    assert_eq!(
        cached(&a, false),
        Some(a.len() as u64 - 1),
        "the same prompt: all but the last token, evaluated again for its logits"
    );
    assert_eq!(cached(&b, false), Some(shared as u64), "the shared prefix");
    assert_eq!(cached(&b, true), Some(0), "GANTRY_STEP_FRESH takes nothing");
}

#[test]
fn a_prompt_that_diverges_early_shares_the_prefix_and_the_warm_slot_keeps_its_history() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(2, 512);
    let (s, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let long = |tail: &str| {
        let tail = std::iter::repeat_n(tail, 12).collect::<Vec<_>>().join(" ");
        format!("A shared system prompt about Paris and France. {tail}")
    };
    let a = s
        .tokenize(&long("First question about the river?"), true, false)
        .expect("tok");
    let b = s
        .tokenize(&long("Second one, on the tower!"), true, false)
        .expect("tok");
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(
        a.len() - shared > 32,
        "A goes on {} tokens past the shared prefix",
        a.len() - shared
    );
    let mut cached = |prompt: &[i32]| {
        let (seq, _) = step_new_sequence(&mut exec, prompt, false);
        let n = exec.seq_cached_tokens(seq);
        exec.seq_release(seq);
        n
    };
    assert_eq!(cached(&a), Some(0));
    // B takes the empty slot with A's prefix shared into it: A's slot is not cut...
    assert_eq!(cached(&b), Some(shared as u64));
    // ...so A comes back to all of its history.
    assert_eq!(cached(&a), Some(a.len() as u64 - 1));
    // With both slots warm, B's own slot serves it.
    assert_eq!(cached(&b), Some(b.len() as u64 - 1));
    // The shared cells give the same answer as a cold evaluation.
    let warm = generate_batched(&mut exec, std::slice::from_ref(&b), 8);
    let (_, mut cold) = plugin.load_model(&desc("cold", &path)).expect("load");
    assert_eq!(
        warm,
        generate_batched(&mut cold, std::slice::from_ref(&b), 8)
    );
}

#[test]
fn a_seeded_sequence_clears_the_cache_of_an_idle_model_but_not_of_a_busy_one() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path(), &TinyModelSpec::default());
    let plugin = llama_plugin(3, 512);
    let (s, mut exec) = plugin.load_model(&desc("tiny", &path)).expect("load");
    let a = s
        .tokenize(
            "A long shared system prompt about Paris. First?",
            true,
            false,
        )
        .expect("tok");
    let b = s
        .tokenize("Another prompt, for a seeded request.", true, false)
        .expect("tok");
    let mut cached = |prompt: &[i32]| {
        let (seq, _) = step_new_sequence(&mut exec, prompt, false);
        let n = exec.seq_cached_tokens(seq);
        exec.seq_release(seq);
        n
    };
    assert_eq!(cached(&a), Some(0), "cold");
    assert_eq!(cached(&a), Some(a.len() as u64 - 1), "warm");
    // A seeded (fresh) sequence while nothing else runs: the cache is cleared, so its cells
    // land in the same places every time; `a`'s warm prefix is gone.
    let (seeded, _) = step_new_sequence(&mut exec, &b, true);
    exec.seq_release(seeded);
    // (Only what `a` shares with the seeded prompt, its first token, is warm now.)
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count() as u64;
    assert!(shared < 4, "the two prompts differ early");
    let (seq, _) = step_new_sequence(&mut exec, &a, false);
    assert_eq!(
        exec.seq_cached_tokens(seq),
        Some(shared),
        "cleared by the seeded sequence"
    );
    // With that sequence still running, a seeded one leaves the warm slots alone.
    let (seeded, _) = step_new_sequence(&mut exec, &b, true);
    exec.seq_release(seeded);
    exec.seq_release(seq);
    let (again, _) = step_new_sequence(&mut exec, &a, false);
    assert_eq!(
        exec.seq_cached_tokens(again),
        Some(a.len() as u64 - 1),
        "a busy model keeps its warm prefixes"
    );
}
