//! The batching decisions (scheduler, each iteration before the engine step), pure functions
//! of the sequences' progress and the engine's limits, so they are unit-tested here rather
//! than only end to end (TGI's `State::next_batch` plays this part there):
//!
//! - [`Load::admits`]: FIFO admission — the head of the queue waits for a free sequence and
//!   KV cells for its whole prompt; nobody overtakes it;
//! - [`plan_step`]: one decode token for every sequence that has one, plus at most the
//!   prefill budget of prompt tokens, given to prompts in order, so a long prompt is fed in
//!   chunks and never stalls the running streams for more than one chunk;
//! - [`embed_batches`]: an embeddings request's inputs cut into engine calls of at most the
//!   same budget of tokens, so steps run between them.

/// An embeddings request's inputs (their token counts, in order) cut into consecutive runs of
/// at most `budget` tokens each, every run at least one input (an input longer than the
/// budget goes alone). Each run is one engine call (ABI 1.8 `embed_batch`).
pub fn embed_batches(lengths: &[usize], budget: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut tokens) = (0, 0usize);
    for (i, &n) in lengths.iter().enumerate() {
        if i > start && tokens + n > budget {
            out.push(start..i);
            (start, tokens) = (i, 0);
        }
        tokens += n;
    }
    if start < lengths.len() {
        out.push(start..lengths.len());
    }
    out
}

/// What the running sequences hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    pub sequences: usize,
    pub kv_tokens: u64,
}

/// The engine's limits that admission respects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub max_sequences: usize,
    pub kv_tokens: u64,
}

impl Load {
    /// Whether a prompt of `prompt_tokens` fits beside what runs.
    pub fn admits(&self, cap: Capacity, prompt_tokens: usize) -> bool {
        self.sequences < cap.max_sequences && self.kv_tokens + prompt_tokens as u64 <= cap.kv_tokens
    }

    /// The load once a prompt of `prompt_tokens` is admitted.
    pub fn with(self, prompt_tokens: usize) -> Load {
        Load {
            sequences: self.sequences + 1,
            kv_tokens: self.kv_tokens + prompt_tokens as u64,
        }
    }
}

/// How many of the waiting prompts (lengths, in queue order) FIFO admission lets in now.
pub fn admissible(load: Load, cap: Capacity, waiting: impl IntoIterator<Item = usize>) -> usize {
    let mut load = load;
    let mut n = 0;
    for prompt in waiting {
        if !load.admits(cap, prompt) {
            break;
        }
        load = load.with(prompt);
        n += 1;
    }
    n
}

/// One running sequence, as planning sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunningSeq {
    pub prompt_tokens: usize,
    /// Prompt tokens already fed.
    pub fed: usize,
    /// Decoding, with a sampled token waiting to be fed back.
    pub has_next: bool,
    /// `prompt_tokens` stops short of the prompt (its last token waits for the forks of an
    /// `n` > 1 request): the chunk that completes them samples nothing.
    pub held: bool,
}

impl RunningSeq {
    pub fn decoding(&self) -> bool {
        self.fed == self.prompt_tokens
    }
}

/// One entry of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// The sequence's index among the running ones.
    pub index: usize,
    /// Prompt tokens fed in this step; 0 for a decode entry (its one sampled token).
    pub prompt_tokens: usize,
    /// The engine samples a token for it: every decode entry, and the chunk that completes a
    /// prompt.
    pub samples: bool,
}

/// The entries of the next step, in the running sequences' order.
pub fn plan_step(running: &[RunningSeq], prefill_budget: usize) -> Vec<Planned> {
    let mut plan = Vec::with_capacity(running.len());
    let mut budget = prefill_budget;
    for (index, r) in running.iter().enumerate() {
        if r.decoding() {
            if r.has_next {
                plan.push(Planned {
                    index,
                    prompt_tokens: 0,
                    samples: true,
                });
            }
        } else if budget > 0 {
            let n = (r.prompt_tokens - r.fed).min(budget);
            budget -= n;
            plan.push(Planned {
                index,
                prompt_tokens: n,
                samples: r.fed + n == r.prompt_tokens && !r.held,
            });
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Capacity = Capacity {
        max_sequences: 2,
        kv_tokens: 100,
    };

    fn prefill(prompt_tokens: usize, fed: usize) -> RunningSeq {
        RunningSeq {
            prompt_tokens,
            fed,
            has_next: false,
            held: false,
        }
    }

    fn decode(prompt_tokens: usize) -> RunningSeq {
        RunningSeq {
            prompt_tokens,
            fed: prompt_tokens,
            has_next: true,
            held: false,
        }
    }

    #[test]
    fn admission_stops_at_the_sequence_limit() {
        assert_eq!(admissible(Load::default(), CAP, [10, 10, 10]), 2);
        let one = Load {
            sequences: 1,
            kv_tokens: 10,
        };
        assert_eq!(admissible(one, CAP, [10, 10]), 1);
    }

    #[test]
    fn admission_needs_kv_for_the_whole_prompt_and_counts_to_the_last_cell() {
        let load = Load {
            sequences: 0,
            kv_tokens: 60,
        };
        assert!(load.admits(CAP, 40), "exactly full fits");
        assert!(!load.admits(CAP, 41));
        assert_eq!(admissible(load, CAP, [41]), 0);
    }

    #[test]
    fn the_head_of_the_queue_is_never_overtaken() {
        // The head needs 90 cells with 50 free; the small prompts behind it wait too.
        let load = Load {
            sequences: 0,
            kv_tokens: 50,
        };
        let cap = Capacity {
            max_sequences: 8,
            kv_tokens: 100,
        };
        assert_eq!(admissible(load, cap, [90, 1, 1]), 0);
        assert_eq!(admissible(load, cap, [1, 90, 1]), 1);
    }

    #[test]
    fn an_empty_queue_admits_nothing() {
        assert_eq!(admissible(Load::default(), CAP, []), 0);
    }

    #[test]
    fn every_decoding_sequence_gets_one_entry_whatever_the_budget() {
        let plan = plan_step(&[decode(5), decode(7)], 0);
        assert_eq!(
            plan,
            vec![
                Planned {
                    index: 0,
                    prompt_tokens: 0,
                    samples: true
                },
                Planned {
                    index: 1,
                    prompt_tokens: 0,
                    samples: true
                },
            ]
        );
    }

    #[test]
    fn a_decoding_sequence_without_a_token_to_feed_is_left_out() {
        let waiting = RunningSeq {
            prompt_tokens: 3,
            fed: 3,
            has_next: false,
            held: false,
        };
        assert!(plan_step(&[waiting], 16).is_empty());
    }

    #[test]
    fn a_long_prompt_is_fed_in_chunks_and_samples_only_with_its_last() {
        let mut p = prefill(20, 0);
        let mut chunks = Vec::new();
        loop {
            let plan = plan_step(&[p], 8);
            assert_eq!(plan.len(), 1);
            chunks.push((plan[0].prompt_tokens, plan[0].samples));
            p.fed += plan[0].prompt_tokens;
            if plan[0].samples {
                break;
            }
        }
        assert_eq!(chunks, vec![(8, false), (8, false), (4, true)]);
    }

    #[test]
    fn a_held_prompt_is_fed_but_for_its_last_token_without_a_sample() {
        // The first choice of an `n` > 1 request: its forks start from these cells, then
        // every choice feeds the last token and samples.
        let held = RunningSeq {
            held: true,
            ..prefill(9, 0)
        };
        assert_eq!(
            plan_step(&[held], 16),
            vec![Planned {
                index: 0,
                prompt_tokens: 9,
                samples: false
            }]
        );
    }

    #[test]
    fn the_prefill_budget_goes_to_prompts_in_order_beside_the_decodes() {
        let plan = plan_step(
            &[prefill(6, 0), decode(4), prefill(10, 2), prefill(3, 0)],
            10,
        );
        assert_eq!(
            plan,
            vec![
                Planned {
                    index: 0,
                    prompt_tokens: 6,
                    samples: true
                },
                Planned {
                    index: 1,
                    prompt_tokens: 0,
                    samples: true
                },
                Planned {
                    index: 2,
                    prompt_tokens: 4,
                    samples: false
                },
            ],
            "the third prompt waits: the budget is spent"
        );
    }

    #[test]
    fn embeddings_are_cut_into_runs_within_the_token_budget() {
        // Inputs fill a run up to the budget; the next one starts a new run.
        assert_eq!(embed_batches(&[3, 4, 5, 2], 8), vec![0..2, 2..4]);
        assert_eq!(embed_batches(&[4, 4, 4], 8), vec![0..2, 2..3]);
        // An input longer than the budget goes alone, and nothing is dropped.
        assert_eq!(embed_batches(&[2, 20, 3], 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(embed_batches(&[20], 8), vec![0..1]);
        assert!(embed_batches(&[], 8).is_empty());
        // Everything fits in one run.
        assert_eq!(embed_batches(&[1; 32], 512), vec![0..32]);
    }
}
