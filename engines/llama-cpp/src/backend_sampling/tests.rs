//! Backend sampling against the host's chains, on Gemma 3 270M (CPU): the same seeded text,
//! the softmax's distribution, host rows in a batch of backend rows, the move to the host.

use gantry_engine_abi::sdk::Model;
use gantry_engine_abi::{SampledToken, Sampling, StepEntry};

use crate::testing::{Loaded, load_gemma};

/// Sampling with `temperature`, `top_k`, `top_p`, `min_p` and `seed`.
fn chain(temperature: f32, top_k: i32, top_p: f32, min_p: f32, seed: u64) -> Sampling {
    Sampling {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        ..Sampling::greedy()
    }
}

/// Gemma with `n` sequences, backend sampling on (`true`) or off, whatever this build's
/// default.
fn gemma(n: u32, backend: bool) -> Loaded {
    let model = load_gemma(n, 256);
    {
        let mut ex = model.exec();
        ex.attacher = if backend {
            let raw =
                super::raw_context(&ex.ctx, model.model.model).expect("the pointer is readable");
            let a = super::Attacher::new(raw);
            // The CPU backend samples every chain this plugin builds.
            a.probe(&mut ex.ctx, model.n_vocab)
                .expect("the probe passes");
            Some(a)
        } else {
            None
        };
    }
    model
}

fn prompt(model: &Loaded, text: &str) -> Vec<i32> {
    model
        .tokenize(text.as_bytes(), true, false)
        .expect("tokenize")
}

/// What `run` saw.
struct Run {
    /// The sampled tokens, by sequence.
    rows: Vec<Vec<SampledToken>>,
    /// By sequence: sampled in the backend at the last step.
    in_backend: Vec<bool>,
}

/// Step every sequence: the first step its prompt, then its last token, `steps` times in
/// all. `mask_from`: from that step on, each entry carries an allowed-token mask letting
/// every token through. `fresh`: no prompt takes a cached prefix (and the cache of an idle
/// model is cleared first), so cells land where they landed in another run.
fn run(
    model: &Loaded,
    prompts: &[Vec<i32>],
    params: &[Sampling],
    steps: usize,
    mask_from: Option<usize>,
    fresh: bool,
) -> Run {
    let seqs: Vec<u64> = prompts
        .iter()
        .map(|_| model.seq_open().expect("seq"))
        .collect();
    let everything = vec![u32::MAX; (model.n_vocab as usize).div_ceil(32)];
    let mut out: Vec<Vec<SampledToken>> = vec![Vec::new(); seqs.len()];
    for step in 0..steps {
        let last: Vec<Vec<i32>> = out
            .iter()
            .zip(prompts)
            .map(|(o, p)| o.last().map_or_else(|| p.clone(), |t| vec![t.token]))
            .collect();
        let entries: Vec<StepEntry<'_>> = seqs
            .iter()
            .zip(&last)
            .zip(params)
            .map(|((&seq, tokens), p)| StepEntry {
                seq,
                tokens,
                sample: Some(p),
                fresh,
                allowed: mask_from
                    .is_some_and(|m| step >= m)
                    .then_some(&everything[..]),
                sample_all: false,
            })
            .collect();
        let got = model.step(&entries).expect("step");
        for (o, t) in out.iter_mut().zip(got) {
            o.push(t.expect("sampled"));
        }
    }
    let in_backend = {
        let ex = model.exec();
        seqs.iter().map(|s| ex.seqs[s].backend.is_some()).collect()
    };
    for s in seqs {
        model.seq_release(s);
    }
    Run {
        rows: out,
        in_backend,
    }
}

fn tokens(run: &Run) -> Vec<Vec<i32>> {
    run.rows
        .iter()
        .map(|r| r.iter().map(|t| t.token).collect())
        .collect()
}

/// Every chain the backend runs whose draw is from a short cut of the vocabulary (top-k,
/// top-p or min-p) or greedy, seeded, four in one batch. (Over thousands of candidates the
/// backend's f32 sums round differently from the host's: see the whole-vocabulary test.)
fn cut_chains() -> Vec<Sampling> {
    let biased = Sampling {
        logit_bias: vec![(1000, 5.0), (2000, -100.0)],
        ..chain(0.9, 40, 1.0, 0.0, 11)
    };
    let greedy_biased = Sampling {
        logit_bias: vec![(107, 3.0)],
        ..Sampling::greedy()
    };
    vec![
        chain(1.0, 40, 1.0, 0.0, 2),
        chain(1.0, 0, 0.9, 0.05, 3),
        chain(0.7, 50, 0.95, 0.02, 4),
        chain(1.2, 0, 1.0, 0.1, 5),
        biased,
        Sampling::greedy(),
        greedy_biased,
        chain(0.8, 20, 0.9, 0.0, 1),
    ]
}

#[test]
fn seeded_sequences_give_the_same_text_with_backend_and_host_sampling() {
    let host = gemma(4, false);
    let backend = gemma(4, true);
    let texts = [
        "The capital of France is",
        "Once upon a time, in a small village,",
        "def fibonacci(n):",
        "My favourite colours are",
    ];
    let prompts: Vec<Vec<i32>> = texts.iter().map(|t| prompt(&host, t)).collect();
    let all = cut_chains();
    for params in all.chunks(4) {
        let want = run(&host, &prompts, params, 24, None, true);
        let got = run(&backend, &prompts, params, 24, None, true);
        assert_eq!(tokens(&got), tokens(&want), "chains {params:?}");
        assert_eq!(got.in_backend, [true; 4], "sampled in the backend");
        assert_eq!(want.in_backend, [false; 4], "sampled on the host");
    }
}

#[test]
fn seeded_draws_from_the_whole_vocabulary_agree_but_for_rounding() {
    // The backend's draw sums the probabilities of all 262,144 tokens in f32, the host's in
    // f64: a uniform that falls within that rounding of a boundary names the neighbour.
    let n = 16;
    let host = gemma(n, false);
    let backend = gemma(n, true);
    let texts = [
        "The capital of France is",
        "Once upon a time,",
        "def main():",
        "Dear Sir,",
    ];
    let prompts: Vec<Vec<i32>> = (0..n as usize)
        .map(|i| prompt(&host, texts[i % texts.len()]))
        .collect();
    let biased = Sampling {
        logit_bias: vec![(1000, 5.0), (2000, -100.0)],
        ..chain(0.9, 0, 1.0, 0.0, 0)
    };
    let (mut tokens_same, mut tokens_all) = (0, 0);
    for base in [chain(0.8, 0, 1.0, 0.0, 0), biased] {
        let params: Vec<Sampling> = (0..u64::from(n))
            .map(|i| Sampling {
                seed: 100 + i,
                ..base.clone()
            })
            .collect();
        let want = tokens(&run(&host, &prompts, &params, 16, None, true));
        let got = tokens(&run(&backend, &prompts, &params, 16, None, true));
        for (g, w) in got.iter().zip(&want) {
            // Tokens drawn before the first divergence (after it the texts differ anyway).
            let same = g.iter().zip(w).take_while(|(a, b)| a == b).count();
            tokens_same += same;
            tokens_all += g.len();
        }
    }
    // Measured: 482 of 512. A draw out of step with the host's (its generator, its order)
    // would diverge at once, every time.
    eprintln!("whole-vocabulary draws: {tokens_same} of {tokens_all} tokens before a divergence");
    assert!(
        tokens_same * 4 >= tokens_all * 3,
        "{tokens_same} of {tokens_all}"
    );
}

/// Pearson's chi-square of `counts` against `probs` (summing to 1).
fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

/// A top-p that keeps the first `n` of `top` (probabilities, descending): halfway between
/// the mass of the first `n - 1` and of the first `n`.
fn top_p_keeping(top: &[(i32, f64)], n: usize) -> f32 {
    let mass = |k: usize| top[..k].iter().map(|(_, p)| p).sum::<f64>();
    ((mass(n - 1) + mass(n)) / 2.0) as f32
}

#[test]
fn backend_draws_follow_the_softmax_after_top_k_top_p_and_min_p() {
    let n = 32;
    let model = gemma(n, true);
    let text = prompt(&model, "My favourite fruit is the");
    // The exact distribution: the top 20 log-probabilities of the next token (at temperature
    // 1, from the host's logits), of a sequence sampled on the host.
    let probe = Sampling {
        top_logprobs: 20,
        ..Sampling::greedy()
    };
    let first = run(&model, std::slice::from_ref(&text), &[probe], 1, None, true);
    assert_eq!(first.in_backend, [false], "logprobs are the host's");
    let top: Vec<(i32, f64)> = first.rows[0][0]
        .top
        .iter()
        .map(|&(t, lp)| (t, f64::from(lp).exp()))
        .collect();
    assert_eq!(top.len(), 20);
    // Each cut falls into a wide gap of the probabilities: a draw's logits are not the
    // probe's to the last bit (other rows share its batch, its prompt comes from the prefix
    // cache), and a near tie at the cut would move a token across it. `wide`: the n in 3..=8
    // whose n-th probability is the most above the next one.
    let wide = (3..=8)
        .max_by(|&a, &b| (top[a - 1].1 / top[a].1).total_cmp(&(top[b - 1].1 / top[b].1)))
        .expect("a cut");
    assert!(
        top[wide - 1].1 > 1.3 * top[wide].1,
        "a wide gap at {wide}: {top:?}"
    );
    // Each cut, and the probabilities of the tokens it keeps, renormalised.
    let cuts: [(Sampling, Vec<(i32, f64)>); 3] = [
        (chain(1.0, wide as i32, 1.0, 0.0, 0), top[..wide].to_vec()),
        // llama.cpp's top-p keeps the smallest head whose mass reaches p: with p halfway
        // between the mass of the first `n - 1` and of the first `n`, the first `n`.
        (
            chain(1.0, 0, top_p_keeping(&top, wide), 0.0, 0),
            top[..wide].to_vec(),
        ),
        // min-p keeps what is at least min_p times the most likely: the first `wide`, with
        // min_p halfway (geometrically) between their last and the next.
        (
            chain(
                1.0,
                0,
                1.0,
                ((top[wide - 1].1 * top[wide].1).sqrt() / top[0].1) as f32,
                0,
            ),
            top[..wide].to_vec(),
        ),
    ];
    for (cut, kept) in cuts {
        assert!(
            kept.len() >= 2,
            "{cut:?} keeps {kept:?}: a draw, not a choice"
        );
        let total: f64 = kept.iter().map(|(_, p)| p).sum();
        let probs: Vec<f64> = kept.iter().map(|(_, p)| p / total).collect();
        let mut counts = vec![0usize; kept.len()];
        // 32 sequences of distinct seeds a step, 24 steps: 768 draws of the first token.
        for round in 0..24u64 {
            let params: Vec<Sampling> = (0..u64::from(n))
                .map(|i| Sampling {
                    seed: 1 + round * 1000 + i,
                    ..cut.clone()
                })
                .collect();
            let prompts = vec![text.clone(); n as usize];
            let got = run(&model, &prompts, &params, 1, None, false);
            assert!(got.in_backend.iter().all(|&b| b));
            for row in got.rows {
                let t = row[0].token;
                let at = kept.iter().position(|&(k, _)| k == t);
                let at = at.unwrap_or_else(|| panic!("{cut:?} drew {t}, outside {kept:?}"));
                counts[at] += 1;
            }
        }
        // df = kept - 1 <= 7; 24.3 is chi-square's 0.999 quantile at 7 degrees of freedom,
        // above every smaller df's.
        let x2 = chi_square(&counts, &probs);
        eprintln!("{cut:?}: counts {counts:?}, chi-square {x2:.2}");
        assert!(
            x2 < 24.3,
            "{cut:?}: counts {counts:?} against {probs:?}, chi-square {x2}"
        );
    }
}

#[test]
fn host_rows_in_a_batch_of_backend_rows_sample_as_without_it() {
    let texts = [
        "The capital of France is",
        "Rain in Spain falls",
        "A list of prime numbers: 2, 3, 5,",
        "The best way to learn to cook is",
    ];
    let penalties = Sampling {
        repetition_penalty: 1.3,
        frequency_penalty: 0.5,
        presence_penalty: 0.4,
        ..chain(0.8, 0, 1.0, 0.0, 7)
    };
    let logprobs = Sampling {
        want_logprob: true,
        top_logprobs: 3,
        ..chain(0.9, 0, 1.0, 0.0, 8)
    };
    let params = [
        penalties,
        chain(0.8, 0, 1.0, 0.0, 9),
        logprobs,
        Sampling::greedy(),
    ];
    let host = gemma(4, false);
    let backend = gemma(4, true);
    let prompts: Vec<Vec<i32>> = texts.iter().map(|t| prompt(&host, t)).collect();
    let want = run(&host, &prompts, &params, 20, None, true);
    let got = run(&backend, &prompts, &params, 20, None, true);
    assert_eq!(got.in_backend, [false, true, false, true]);
    assert_eq!(tokens(&got), tokens(&want));
    // The logprobs row: the same numbers, three alternatives each.
    for (g, w) in got.rows[2].iter().zip(&want.rows[2]) {
        assert!(g.logprob.is_finite() && g.logprob <= 0.0, "{g:?}");
        assert_eq!(g.logprob, w.logprob);
        assert_eq!(g.top, w.top);
        assert_eq!(g.top.len(), 3);
    }
}

#[test]
fn a_sequence_that_meets_a_mask_moves_to_the_host_and_draws_on() {
    let host = gemma(2, false);
    let backend = gemma(2, true);
    let prompts = vec![prompt(&host, "Once upon a time"), prompt(&host, "In 1969,")];
    let params = [chain(1.0, 0, 1.0, 0.0, 21), chain(0.9, 30, 0.95, 0.0, 22)];
    // Masks (letting every token through) from the 9th step: the backend's sequences move to
    // the host there, and the seeded draws go on as on the host all along.
    let want = run(&host, &prompts, &params, 20, None, true);
    let got = run(&backend, &prompts, &params, 20, Some(8), true);
    assert_eq!(got.in_backend, [false, false], "moved to the host");
    assert_eq!(tokens(&got), tokens(&want));
    let before = run(&backend, &prompts, &params, 8, None, true);
    assert_eq!(
        before.in_backend,
        [true, true],
        "in the backend before the masks"
    );
}

#[test]
fn a_slot_keeps_a_greedy_chain_for_the_next_greedy_sequence_and_drops_it_for_the_host() {
    // One slot, so every request lands on it: greedy, greedy (the same chain, attached once),
    // seeded (replaced), logprobs (detached: the host needs the row's logits), greedy again.
    let logprobs = Sampling {
        want_logprob: true,
        top_logprobs: 2,
        ..Sampling::greedy()
    };
    let requests = [
        Sampling::greedy(),
        Sampling::greedy(),
        chain(0.9, 40, 0.95, 0.0, 5),
        logprobs,
        Sampling::greedy(),
    ];
    let host = gemma(1, false);
    let backend = gemma(1, true);
    let text = [prompt(&host, "The three primary colours are")];
    let chain_of = |model: &Loaded| {
        let ex = model.exec();
        ex.free_slots[0]
            .backend
            .as_ref()
            .map(super::BackendChain::id)
    };
    let mut chains = Vec::new();
    for p in &requests {
        let want = run(&host, &text, std::slice::from_ref(p), 6, None, false);
        let got = run(&backend, &text, std::slice::from_ref(p), 6, None, false);
        assert_eq!(tokens(&got), tokens(&want), "{p:?}");
        assert_eq!(got.rows[0][5].logprob.is_finite(), p.want_logprob);
        assert_eq!(got.rows[0][5].top, want.rows[0][5].top);
        chains.push(chain_of(&backend));
    }
    let [g1, g2, seeded, host_row, g3] = chains[..] else {
        unreachable!()
    };
    assert!(
        g1.is_some() && seeded.is_some() && g3.is_some(),
        "{chains:?}"
    );
    assert_eq!(g1, g2, "the greedy chain is kept");
    assert_ne!(seeded, g2, "a seeded draw gets its own chain");
    assert_eq!(host_row, None, "a host sequence detaches the slot's chain");
}
