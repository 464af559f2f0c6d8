//! LoRA adapters in the llama.cpp plugin (ABI 1.6, engine layer, below the scheduler), through
//! the engine host on SmolLM2-135M-Instruct and the test adapters of
//! `testkit/python/smollm2_lora.py` (`$GANTRY_SMOLLM2_ADAPTERS`): an adapter changes what a
//! sequence generates, sequences of the base and of several adapters stepped together each get
//! what they get alone, adapters that do not fit are refused with a message naming the tensor or
//! the architecture and leave the model serving, a fork keeps its source's adapter, a warm
//! prefix serves only its own adapter, and unloading leaves the base serving.

mod common;

use std::path::{Path, PathBuf};
use std::time::Instant;

use common::*;
use gantry_engine_abi::{AdapterDescriptor, EngineError, Format, Sampling, Status, StepEntry};
use gantry_node::engine_host::{ModelExec, ModelShared};

/// Greedy tokens each sequence generates.
const N: usize = 16;

/// The adapters' directory, or `None` (printed) when the environment has none.
fn adapters_dir() -> Option<PathBuf> {
    let Some(dir) = std::env::var_os("GANTRY_SMOLLM2_ADAPTERS").map(PathBuf::from) else {
        eprintln!(
            "SKIPPED: GANTRY_SMOLLM2_ADAPTERS is not set (the SmolLM2 test adapters of \
             testkit/python/smollm2_lora.py; scripts/test.sh's environment sets it)"
        );
        return None;
    };
    assert!(
        dir.join("pirate.gguf").is_file(),
        "GANTRY_SMOLLM2_ADAPTERS is {} but holds no pirate.gguf: run testkit/python/smollm2_lora.py",
        dir.display()
    );
    Some(dir)
}

/// SmolLM2-135M-Instruct (Q4_1 GGUF), the base of the test adapters.
fn smollm2() -> PathBuf {
    let p = std::env::var_os("GANTRY_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .expect("GANTRY_SMOLLM2_GGUF must name SmolLM2-135M-Instruct's GGUF beside the adapters");
    assert!(p.is_file(), "{} is missing", p.display());
    p
}

/// The plugin with SmolLM2 loaded for `seqs` sequences of 512 tokens, or `None` when skipped.
fn setup(seqs: u32) -> Option<(PathBuf, std::sync::Arc<ModelShared>, ModelExec)> {
    let dir = adapters_dir()?;
    let plugin = llama_plugin(seqs, 512);
    assert!(
        plugin.info().supports_adapters(),
        "the plugin declares GANTRY_CAP_ADAPTERS"
    );
    let (shared, exec) = plugin
        .load_model(&desc("smollm2", &smollm2()))
        .expect("load SmolLM2");
    Some((dir, shared, exec))
}

fn adapter(name: &str, path: &Path) -> AdapterDescriptor {
    AdapterDescriptor {
        name: name.into(),
        path: path.to_path_buf(),
        format: Format::Gguf,
        scale: 1.0,
    }
}

/// Load `<dir>/<name>.gguf`; its id.
fn load(exec: &mut ModelExec, dir: &Path, name: &str) -> u64 {
    let path = dir.join(format!("{name}.gguf"));
    let loaded = exec
        .adapter_load(&adapter(name, &path))
        .unwrap_or_else(|e| panic!("load {name}: {e}"));
    assert_ne!(loaded.id, 0);
    let file = std::fs::metadata(&path).expect("adapter file").len();
    assert!(
        loaded.bytes > file / 2 && loaded.bytes <= file,
        "{name}: {} bytes of tensors in a file of {file}",
        loaded.bytes
    );
    loaded.id
}

fn prompt(shared: &ModelShared, text: &str) -> Vec<i32> {
    shared.tokenize(text, true, false).expect("tokenize")
}

/// A new sequence running `adapter` (0 = the base).
fn open(exec: &mut ModelExec, adapter: u64) -> u64 {
    let seq = exec.seq_open().expect("seq_open");
    exec.seq_set_adapter(seq, adapter).expect("seq_set_adapter");
    seq
}

/// Step the open sequences together `n` times, greedily: the first step feeds each its `feed`
/// (as a fresh sequence when `fresh`), every later one the token it sampled.
fn together(exec: &mut ModelExec, seqs: &[u64], feed: &[Vec<i32>], fresh: bool) -> Vec<Vec<i32>> {
    let g = Sampling::greedy();
    let mut feed = feed.to_vec();
    let mut outs = vec![Vec::new(); seqs.len()];
    for i in 0..N {
        let entries: Vec<StepEntry<'_>> = seqs
            .iter()
            .zip(&feed)
            .map(|(&seq, tokens)| StepEntry {
                seq,
                tokens,
                sample: Some(&g),
                fresh: fresh && i == 0,
                allowed: None,
                sample_all: false,
            })
            .collect();
        let res = exec.step(&entries).expect("step");
        for (k, r) in res.into_iter().enumerate() {
            let t = r.expect("sampled").token;
            outs[k].push(t);
            feed[k] = vec![t];
        }
    }
    outs
}

/// What a sequence running `adapter` generates alone after `prompt`, from an empty cache.
fn alone(exec: &mut ModelExec, adapter: u64, prompt: &[i32]) -> Vec<i32> {
    let seq = open(exec, adapter);
    let out = together(exec, &[seq], &[prompt.to_vec()], true).remove(0);
    exec.seq_release(seq);
    out
}

/// What a sequence running `adapter` generates from an empty cache when fed `prompt` but its
/// last token first, then the last token: a fork's or a warm prefix's way. An adapter's f32
/// tensors round differently for one row than for several (ggml multiplies f32 matrices by a
/// dot product for one row and by tinyBLAS for two or more), so with these random adapters
/// this may differ from [`alone`] after a few tokens; the Q4_1 base's kernels do not.
fn split_alone(exec: &mut ModelExec, adapter: u64, prompt: &[i32]) -> Vec<i32> {
    let (head, last) = prompt.split_at(prompt.len() - 1);
    let seq = open(exec, adapter);
    feed_head(exec, seq, head);
    let out = together(exec, &[seq], &[last.to_vec()], false).remove(0);
    exec.seq_release(seq);
    out
}

/// Step `tokens` into `seq` without sampling, as a fresh sequence.
fn feed_head(exec: &mut ModelExec, seq: u64, tokens: &[i32]) {
    exec.step(&[StepEntry {
        seq,
        tokens,
        sample: None,
        fresh: true,
        allowed: None,
        sample_all: false,
    }])
    .expect("a prompt but its last token");
}

fn text(shared: &ModelShared, tokens: &[i32]) -> String {
    String::from_utf8_lossy(&shared.detokenize(tokens, false).expect("detok")).into_owned()
}

#[test]
fn an_adapter_changes_the_greedy_text_and_two_adapters_differ() {
    let Some((dir, shared, mut exec)) = setup(2) else {
        return;
    };
    let (pirate, formal) = (
        load(&mut exec, &dir, "pirate"),
        load(&mut exec, &dir, "formal"),
    );
    assert_ne!(pirate, formal);
    let p = prompt(&shared, "The best way to cross the sea is");
    let base = alone(&mut exec, 0, &p);
    let with_pirate = alone(&mut exec, pirate, &p);
    let with_formal = alone(&mut exec, formal, &p);
    eprintln!("base:   {:?}", text(&shared, &base));
    eprintln!("pirate: {:?}", text(&shared, &with_pirate));
    eprintln!("formal: {:?}", text(&shared, &with_formal));
    assert_ne!(with_pirate, base, "pirate changes the text");
    assert_ne!(with_formal, base, "formal changes the text");
    assert_ne!(with_pirate, with_formal, "the two adapters differ");
    // Each again, after the others ran: the context's adapter follows the sequence.
    assert_eq!(alone(&mut exec, 0, &p), base);
    assert_eq!(alone(&mut exec, pirate, &p), with_pirate);
}

#[test]
fn a_step_mixing_the_base_and_two_adapters_gives_each_sequence_what_it_gets_alone() {
    let Some((dir, shared, mut exec)) = setup(6) else {
        return;
    };
    let (pirate, formal) = (
        load(&mut exec, &dir, "pirate"),
        load(&mut exec, &dir, "formal"),
    );
    let a = prompt(&shared, "The best way to cross the sea is");
    let b = prompt(&shared, "Dear committee, I write to you about");
    // Entries in an order that is not the groups' (pirate, base, formal, base). One sequence
    // per adapter: an adapter's tensors are f32, and ggml multiplies f32 matrices by a dot
    // product for one row and by tinyBLAS for two or more, which round differently (the Q4_1
    // base's kernel is the same for any number of rows); these random adapters carry that
    // rounding into another greedy token within a dozen tokens, as an f32 model's weights
    // would. Two sequences of one adapter are checked against the same two stepped without
    // the other groups below.
    let plan = [(pirate, &a), (0, &b), (formal, &a), (0, &a)];
    let want: Vec<Vec<i32>> = plan
        .iter()
        .map(|(ad, p)| alone(&mut exec, *ad, p))
        .collect();
    assert_ne!(
        want[0], want[3],
        "pirate and the base differ on the same prompt"
    );
    assert_ne!(
        want[0], want[2],
        "pirate and formal differ on the same prompt"
    );
    let seqs: Vec<u64> = plan.iter().map(|(ad, _)| open(&mut exec, *ad)).collect();
    let feed: Vec<Vec<i32>> = plan.iter().map(|(_, p)| p.to_vec()).collect();
    let got = together(&mut exec, &seqs, &feed, true);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "sequence {i} (adapter {})", plan[i].0);
    }
    for s in seqs {
        exec.seq_release(s);
    }

    // Two pirate sequences beside the base and formal get what the two get by themselves.
    let pair = |exec: &mut ModelExec| {
        let seqs = [open(exec, pirate), open(exec, pirate)];
        let out = together(exec, &seqs, &[a.clone(), b.clone()], true);
        seqs.into_iter().for_each(|s| exec.seq_release(s));
        out
    };
    let want = pair(&mut exec);
    let seqs = [
        open(&mut exec, formal),
        open(&mut exec, pirate),
        open(&mut exec, 0),
        open(&mut exec, pirate),
    ];
    let got = together(
        &mut exec,
        &seqs,
        &[b.clone(), a.clone(), a.clone(), b.clone()],
        true,
    );
    assert_eq!([&got[1], &got[3]], [&want[0], &want[1]]);
    for s in seqs {
        exec.seq_release(s);
    }
}

#[test]
fn adapters_that_do_not_fit_are_refused_naming_what_and_the_model_serves_as_before() {
    let Some((dir, shared, mut exec)) = setup(2) else {
        return;
    };
    let p = prompt(&shared, "The best way to cross the sea is");
    let base = alone(&mut exec, 0, &p);
    let refused = |exec: &mut ModelExec, file: &str| -> EngineError {
        exec.adapter_load(&adapter(file, &dir.join(file)))
            .expect_err(file)
    };
    let e = refused(&mut exec, "bad-shape.gguf");
    eprintln!("bad-shape.gguf: {e}");
    assert_eq!(e.status, Status::LoadFailed, "{e}");
    assert!(
        e.message
            .contains("`blk.0.attn_q.weight.lora_a` is [512, 8]")
            && e.message.contains("`blk.0.attn_q.weight` [576, 576]")
            && e.message.contains("input size 576"),
        "the tensor and both shapes: {e}"
    );
    let e = refused(&mut exec, "other-base.gguf");
    eprintln!("other-base.gguf: {e}");
    assert_eq!(e.status, Status::LoadFailed, "{e}");
    assert!(
        e.message.contains("`gemma3`") && e.message.contains("`llama`"),
        "both architectures: {e}"
    );
    // Not a GGUF file, and no file at all: unreadable.
    let junk = tempfile::tempdir().expect("tempdir");
    std::fs::write(junk.path().join("junk.gguf"), b"not a gguf file").expect("write");
    let e = exec
        .adapter_load(&adapter("junk", &junk.path().join("junk.gguf")))
        .expect_err("junk");
    assert_eq!(e.status, Status::ModelCorrupt, "{e}");
    let e = refused(&mut exec, "missing.gguf");
    assert_eq!(e.status, Status::ModelCorrupt, "{e}");
    // The base model itself is no adapter.
    let e = exec
        .adapter_load(&adapter("model", &smollm2()))
        .expect_err("a model file");
    assert_eq!(e.status, Status::LoadFailed, "{e}");
    assert!(e.message.contains("general.type"), "{e}");

    assert_eq!(
        alone(&mut exec, 0, &p),
        base,
        "the base generates as before"
    );
    // And a good adapter still loads after the refusals.
    let pirate = load(&mut exec, &dir, "pirate");
    assert_ne!(alone(&mut exec, pirate, &p), base);
}

#[test]
fn a_fork_of_a_pirate_sequence_continues_with_pirate() {
    let Some((dir, shared, mut exec)) = setup(3) else {
        return;
    };
    let pirate = load(&mut exec, &dir, "pirate");
    let p = prompt(&shared, "The best way to cross the sea is");
    let want = split_alone(&mut exec, pirate, &p);
    let want_base = alone(&mut exec, 0, &p);
    assert_ne!(
        split_alone(&mut exec, 0, &p),
        want,
        "the base fed so differs"
    );
    // The parent is fed the prompt but its last token, then forked.
    let (head, last) = p.split_at(p.len() - 1);
    let parent = open(&mut exec, pirate);
    feed_head(&mut exec, parent, head);
    let child = exec.seq_fork(parent).expect("fork");
    // The fork goes on beside a base sequence (one sequence per adapter in each step: see
    // the mixed-step test), then the parent on its own.
    let base_seq = open(&mut exec, 0);
    let got = together(
        &mut exec,
        &[base_seq, child],
        &[p.clone(), last.to_vec()],
        false,
    );
    assert_eq!(got[1], want, "the fork runs pirate");
    assert_eq!(got[0], want_base, "the base sequence beside it does not");
    let got = together(&mut exec, &[parent], &[last.to_vec()], false);
    assert_eq!(got[0], want, "the parent still runs pirate");
    for s in [child, parent, base_seq] {
        exec.seq_release(s);
    }
}

#[test]
fn a_warm_prefix_serves_only_sequences_of_its_own_adapter() {
    let Some((dir, shared, mut exec)) = setup(4) else {
        return;
    };
    let pirate = load(&mut exec, &dir, "pirate");
    let p = prompt(
        &shared,
        "The best way to cross the sea is to build a boat, and then",
    );
    // A warm prefix leaves the prompt's last token to evaluate (for its logits), as
    // `split_alone` does. Pirate first: the base's fresh runs then empty the cache of
    // pirate's warm cells.
    let want_pirate = alone(&mut exec, pirate, &p);
    let want_pirate_warm = split_alone(&mut exec, pirate, &p);
    let want_base = alone(&mut exec, 0, &p);
    assert_eq!(
        split_alone(&mut exec, 0, &p),
        want_base,
        "the base's kernels do not"
    );
    // Base sequences leave their cells warm (not fresh: they may take them, and do later).
    let first = |exec: &mut ModelExec, adapter: u64| -> (Vec<i32>, Option<u64>) {
        let seq = open(exec, adapter);
        let out = together(exec, &[seq], std::slice::from_ref(&p), false).remove(0);
        let cached = exec.seq_cached_tokens(seq);
        exec.seq_release(seq);
        (out, cached)
    };
    let (out, _) = first(&mut exec, 0);
    assert_eq!(out, want_base);
    // Under pirate the base's warm prompt is no prefix: evaluated whole, pirate's text.
    let (out, cached) = first(&mut exec, pirate);
    assert_eq!(cached, Some(0), "nothing taken from the base's warm slot");
    assert_eq!(out, want_pirate);
    // Pirate's own warm prompt is, and so is the base's for the base.
    let (out, cached) = first(&mut exec, pirate);
    assert!(
        cached.is_some_and(|c| c > 0),
        "pirate reuses its own: {cached:?}"
    );
    assert_eq!(out, want_pirate_warm);
    let (out, cached) = first(&mut exec, 0);
    assert!(
        cached.is_some_and(|c| c > 0),
        "the base reuses its own: {cached:?}"
    );
    assert_eq!(out, want_base);
}

#[test]
fn a_verification_under_an_adapter_beside_a_base_sequence_accepts_its_own_continuation() {
    let Some((dir, shared, mut exec)) = setup(2) else {
        return;
    };
    let pirate = load(&mut exec, &dir, "pirate");
    let p = prompt(&shared, "The best way to cross the sea is");
    let q = prompt(&shared, "Dear committee, I write to you about");
    let want_pirate = alone(&mut exec, pirate, &p);
    let want_base = alone(&mut exec, 0, &q);
    let g = Sampling::greedy();
    let entry = |seq, tokens, fresh, sample_all| StepEntry {
        seq,
        tokens,
        sample: Some(&g),
        fresh,
        allowed: None,
        sample_all,
    };
    let tokens = |out: Vec<Option<gantry_engine_abi::SampledToken>>| -> Vec<i32> {
        out.into_iter().map(|t| t.expect("sampled").token).collect()
    };
    let (ps, bs) = (open(&mut exec, pirate), open(&mut exec, 0));
    let first = exec
        .step(&[entry(ps, &p, true, false), entry(bs, &q, true, false)])
        .expect("prompts");
    assert_eq!(tokens(first), [want_pirate[0], want_base[0]]);
    // Pirate verifies its next 6 tokens as drafts while the base decodes one; then 4 more.
    let feed = [want_base[0]];
    let out = exec
        .step(&[
            entry(ps, &want_pirate[..6], false, true),
            entry(bs, &feed, false, false),
        ])
        .expect("verification step");
    let got = tokens(out);
    assert_eq!(got[..6], want_pirate[1..7], "the samples after each draft");
    assert_eq!(got[6], want_base[1], "the base sequence's token");
    exec.seq_release(ps);
    exec.seq_release(bs);
}

#[test]
fn unloading_an_adapter_leaves_the_base_serving() {
    let Some((dir, shared, mut exec)) = setup(2) else {
        return;
    };
    let p = prompt(&shared, "The best way to cross the sea is");
    let base = alone(&mut exec, 0, &p);
    let pirate = load(&mut exec, &dir, "pirate");
    // Pirate ran last, so it is the context's adapter when it goes.
    let with_pirate = alone(&mut exec, pirate, &p);
    assert_ne!(with_pirate, base);
    exec.adapter_unload(pirate);
    exec.adapter_unload(pirate); // an unknown id: nothing
    assert_eq!(alone(&mut exec, 0, &p), base, "the base after the unload");
    let seq = exec.seq_open().expect("seq_open");
    let e = exec
        .seq_set_adapter(seq, pirate)
        .expect_err("an unloaded adapter");
    assert_eq!(e.status, Status::Internal, "{e}");
    exec.seq_release(seq);
    // Loaded again it gets a new id and the same text.
    let again = load(&mut exec, &dir, "pirate");
    assert_ne!(again, pirate);
    assert_eq!(alone(&mut exec, again, &p), with_pirate);
}

#[test]
fn a_peft_directory_is_refused_as_unsupported() {
    let Some((dir, _shared, mut exec)) = setup(1) else {
        return;
    };
    let e = exec
        .adapter_load(&AdapterDescriptor {
            format: Format::Safetensors,
            ..adapter("pirate", &dir.join("pirate"))
        })
        .expect_err("PEFT");
    assert_eq!(e.status, Status::Unsupported, "{e}");
    assert!(e.message.contains("convert_lora_to_gguf.py"), "{e}");
}

/// The cost of a mixed step (run it with `--ignored --nocapture` on an otherwise idle machine):
/// the median decode step of three sequences on the base, all on pirate, on pirate + formal and
/// on the base + pirate + formal, the four interleaved over three rounds.
#[test]
#[ignore = "a measurement, not a check"]
fn measure_a_mixed_step_against_a_single_adapter_step() {
    let Some((dir, shared, mut exec)) = setup(3) else {
        return;
    };
    let (pirate, formal) = (
        load(&mut exec, &dir, "pirate"),
        load(&mut exec, &dir, "formal"),
    );
    let p = prompt(&shared, "The best way to cross the sea is");
    let g = Sampling::greedy();
    let mut run = |adapters: [u64; 3], took: &mut Vec<f64>| {
        let seqs: Vec<u64> = adapters.iter().map(|&a| open(&mut exec, a)).collect();
        let mut feed = vec![p.clone(); 3];
        for i in 0..24 {
            let entries: Vec<StepEntry<'_>> = seqs
                .iter()
                .zip(&feed)
                .map(|(&seq, tokens)| StepEntry {
                    seq,
                    tokens,
                    sample: Some(&g),
                    fresh: i == 0,
                    allowed: None,
                    sample_all: false,
                })
                .collect();
            let t = Instant::now();
            let res = exec.step(&entries).expect("step");
            if i >= 4 {
                took.push(t.elapsed().as_secs_f64() * 1e3);
            }
            for (k, r) in res.into_iter().enumerate() {
                feed[k] = vec![r.expect("sampled").token];
            }
        }
        for s in seqs {
            exec.seq_release(s);
        }
    };
    let configs = [
        ("base", [0, 0, 0]),
        ("all pirate", [pirate, pirate, pirate]),
        ("pirate + formal", [pirate, pirate, formal]),
        ("base + pirate + formal", [0, pirate, formal]),
    ];
    let mut took = vec![Vec::new(); configs.len()];
    // llama.cpp logs how long each graph reservation (one per adapter switch) took.
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        for _ in 0..3 {
            for (c, t) in configs.iter().zip(&mut took) {
                run(c.1, t);
            }
        }
    });
    let log = String::from_utf8_lossy(&log.0.lock().expect("log")).into_owned();
    let mut reserves: Vec<f64> = log
        .lines()
        .filter_map(|l| {
            l.split("reserve took ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    reserves.sort_by(f64::total_cmp);
    if let Some(median) = reserves.get(reserves.len() / 2) {
        eprintln!(
            "{} graph reservations (adapter switches), median {median:.2} ms",
            reserves.len()
        );
    }
    for ((name, _), t) in configs.iter().zip(&mut took) {
        t.sort_by(f64::total_cmp);
        eprintln!(
            "decode step of 3 sequences, {name}: median {:.2} ms (p10 {:.2}, p90 {:.2})",
            t[t.len() / 2],
            t[t.len() / 10],
            t[t.len() * 9 / 10]
        );
    }
}

/// A log sink for the measurement.
#[derive(Clone, Default)]
struct Log(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
