//! Native engine, CPU backend: a mixture-of-experts MLP over one step's tokens (the MLP half of
//! a decoder layer whose [`crate::config::LayerKind::moe`] is set).
//!
//! The router scores every expert for every token in one product; each token keeps its
//! `top_k` experts, weighted by the softmax of the scores (renormalised over the chosen ones
//! when the config says so), or, with DeepSeek-V3's routing (Nemotron-H), chosen by sigmoid
//! score plus a per-expert bias within the best groups and weighted by the sigmoid scores. The dispatch is batched by expert, not by token: the rows of
//! every token routed to an expert are gathered into one matrix, the expert's gate, up and down
//! products run once over it, and the weighted rows are added back to their tokens. A decode
//! step of many sequences thus reads each chosen expert's weights once.

use rayon::prelude::*;

use crate::backend::Ffn;
use crate::config::{Activation, Moe, Routing};
use crate::weights::Weights;

use super::matmul::Linear;
use super::ops;

/// Each token's chosen experts and their weights, `top_k` per token, best first;
/// `choice_bias` is [`Routing::Sigmoid`]'s per-expert bias.
pub fn route(
    scores: &[f32],
    t: usize,
    moe: &Moe,
    choice_bias: Option<&[f32]>,
) -> Vec<Vec<(usize, f32)>> {
    let e = moe.experts;
    if let Routing::Sigmoid {
        groups,
        topk_groups,
        scale,
    } = moe.routing
    {
        return (0..t)
            .map(|i| {
                let sig: Vec<f32> = scores[i * e..(i + 1) * e]
                    .iter()
                    .map(|s| 1.0 / (1.0 + (-s).exp()))
                    .collect();
                let mut choice: Vec<f32> = match choice_bias {
                    Some(bias) => sig.iter().zip(bias).map(|(s, b)| s + b).collect(),
                    None => sig.clone(),
                };
                if groups > 1 {
                    // A group's score is the sum of its two best; the experts of all but the
                    // `topk_groups` best groups are out.
                    let per = e / groups;
                    let score = |g: usize| {
                        let (best, second) = choice[g * per..(g + 1) * per].iter().fold(
                            (f32::NEG_INFINITY, f32::NEG_INFINITY),
                            |(a, b), &v| {
                                if v > a { (v, a) } else { (a, b.max(v)) }
                            },
                        );
                        best + second
                    };
                    let mut order: Vec<usize> = (0..groups).collect();
                    let gs: Vec<f32> = order.iter().map(|&g| score(g)).collect();
                    order.sort_by(|&a, &b| gs[b].total_cmp(&gs[a]).then(a.cmp(&b)));
                    for &g in &order[topk_groups..] {
                        choice[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
                    }
                }
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
                order.truncate(moe.top_k);
                let mut chosen: Vec<(usize, f32)> = order.iter().map(|&x| (x, sig[x])).collect();
                let norm = if moe.normalize {
                    chosen.iter().map(|(_, w)| w).sum::<f32>() + 1e-20
                } else {
                    1.0
                };
                chosen.iter_mut().for_each(|(_, w)| *w = *w / norm * scale);
                chosen
            })
            .collect();
    }
    (0..t)
        .map(|i| {
            let row = &scores[i * e..(i + 1) * e];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = row.iter().map(|s| (s - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            let mut order: Vec<usize> = (0..e).collect();
            // The highest probabilities first; equal ones by expert index, as a stable top-k.
            order.select_nth_unstable_by(moe.top_k - 1, |&a, &b| {
                exps[b].total_cmp(&exps[a]).then(a.cmp(&b))
            });
            order.truncate(moe.top_k);
            order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
            let mut chosen: Vec<(usize, f32)> = order.iter().map(|&x| (x, exps[x] / sum)).collect();
            if moe.normalize {
                let kept: f32 = chosen.iter().map(|(_, w)| w).sum();
                chosen.iter_mut().for_each(|(_, w)| *w /= kept);
            }
            chosen
        })
        .collect()
}

/// The tokens routed to each expert, with their weights, in token order.
pub fn by_expert(routes: &[Vec<(usize, f32)>], experts: usize) -> Vec<Vec<(usize, f32)>> {
    let mut groups = vec![Vec::new(); experts];
    for (tok, chosen) in routes.iter().enumerate() {
        for &(e, w) in chosen {
            groups[e].push((tok, w));
        }
    }
    groups
}

/// The layer's mixture of experts: the MLP output of `x` (`[t][h]`) into `out` (`[t][h]`).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    w: &Weights,
    (router, choice_bias): (&Linear, Option<&[f32]>),
    experts: &[Ffn<Linear>],
    shared: Option<&(Ffn<Linear>, Option<Linear>)>,
    moe: &Moe,
    activation: Activation,
    x: &[f32],
    t: usize,
    h: usize,
    out: &mut [f32],
    scratch: &mut Vec<u16>,
) {
    let mut scores = vec![0.0f32; t * moe.experts];
    router.forward(w, x, t, &mut scores, scratch);
    let groups = by_expert(&route(&scores, t, moe, choice_bias), moe.experts);
    out.fill(0.0);
    // The experts a step uses run side by side on the pool (each one's products are small
    // in decode: a few rows), then their weighted rows are added back in expert order, so the
    // sums do not depend on which finished first.
    let outputs: Vec<(usize, Vec<f32>)> = experts
        .par_iter()
        .zip(&groups)
        .enumerate()
        .filter(|(_, (_, group))| !group.is_empty())
        .map(|(e, (expert, group))| {
            let n = group.len();
            let mut xs = Vec::with_capacity(n * h);
            for &(tok, _) in group {
                xs.extend_from_slice(&x[tok * h..(tok + 1) * h]);
            }
            let mut y = vec![0.0f32; n * h];
            ffn(w, expert, activation, &xs, n, &mut y, &mut Vec::new());
            (e, y)
        })
        .collect();
    for (e, y) in outputs {
        for (r, &(tok, weight)) in groups[e].iter().enumerate() {
            let dst = &mut out[tok * h..(tok + 1) * h];
            for (d, s) in dst.iter_mut().zip(&y[r * h..(r + 1) * h]) {
                *d += weight * s;
            }
        }
    }
    // The shared expert runs every token; its output is weighted by a sigmoid gate per token
    // where it has one.
    if let Some((expert, gate)) = shared {
        let mut y = vec![0.0f32; t * h];
        ffn(w, expert, activation, x, t, &mut y, scratch);
        // Ungated (Granite): weight 1.
        let weights: Vec<f32> = match gate {
            Some(gate) => {
                let mut score = vec![0.0f32; t];
                gate.forward(w, x, t, &mut score, scratch);
                score.iter().map(|s| 1.0 / (1.0 + (-s).exp())).collect()
            }
            None => vec![1.0; t],
        };
        for (tok, &weight) in weights.iter().enumerate() {
            let dst = &mut out[tok * h..(tok + 1) * h];
            for (d, v) in dst.iter_mut().zip(&y[tok * h..(tok + 1) * h]) {
                *d += weight * v;
            }
        }
    }
}

/// One expert's MLP over `n` rows of `x` into `y` (`[n][h]`).
fn ffn(
    w: &Weights,
    f: &Ffn<Linear>,
    activation: Activation,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    scratch: &mut Vec<u16>,
) {
    let ff = f.up.rows;
    let (mut g, mut u) = (vec![0.0f32; n * ff], vec![0.0f32; n * ff]);
    if let Some(gate) = &f.gate {
        gate.forward(w, x, n, &mut g, scratch);
    }
    f.up.forward(w, x, n, &mut u, scratch);
    ops::activate(activation, &mut g, &u);
    f.down.forward(w, &g, n, y, scratch);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MoeNaming;

    fn moe(experts: usize, top_k: usize, normalize: bool) -> Moe {
        Moe {
            experts,
            top_k,
            intermediate: 4,
            normalize,
            naming: MoeNaming::Qwen,
            shared: None,
            shared_gate: false,
            routing: Routing::Softmax,
        }
    }

    #[test]
    fn routing_keeps_the_top_k_softmax_weights_renormalised_only_when_asked() {
        let scores = [0.0, 2.0, 1.0, -1.0];
        let p: Vec<f32> = {
            let e: Vec<f32> = scores.iter().map(|s: &f32| s.exp()).collect();
            let sum: f32 = e.iter().sum();
            e.iter().map(|x| x / sum).collect()
        };
        let raw = route(&scores, 1, &moe(4, 2, false), None);
        assert_eq!(raw[0].iter().map(|c| c.0).collect::<Vec<_>>(), [1, 2]);
        assert!((raw[0][0].1 - p[1]).abs() < 1e-6 && (raw[0][1].1 - p[2]).abs() < 1e-6);
        let norm = route(&scores, 1, &moe(4, 2, true), None);
        let kept = p[1] + p[2];
        assert!((norm[0][0].1 - p[1] / kept).abs() < 1e-6);
        assert!((norm[0][0].1 + norm[0][1].1 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn tokens_are_grouped_by_expert_in_token_order() {
        // Token 0 → experts 1, 0; token 1 → experts 1, 2.
        let scores = [1.0, 3.0, 0.0, 0.0, 3.0, 1.0];
        let groups = by_expert(&route(&scores, 2, &moe(3, 2, true), None), 3);
        assert_eq!(groups[0].iter().map(|g| g.0).collect::<Vec<_>>(), [0]);
        assert_eq!(groups[1].iter().map(|g| g.0).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(groups[2].iter().map(|g| g.0).collect::<Vec<_>>(), [1]);
    }

    #[test]
    fn sigmoid_routing_chooses_by_biased_score_in_the_best_groups_and_weights_by_sigmoid() {
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let spec = Moe {
            routing: Routing::Sigmoid {
                groups: 2,
                topk_groups: 1,
                scale: 2.5,
            },
            ..moe(4, 2, true)
        };
        // Group 0 = experts 0, 1; group 1 = experts 2, 3. Expert 2 scores highest alone, but
        // group 0's two best sum higher, so both choices come from group 0.
        let scores = [1.0, 0.9, 2.0, -3.0];
        let r = route(&scores, 1, &spec, None);
        assert_eq!(r[0].iter().map(|c| c.0).collect::<Vec<_>>(), [0, 1]);
        let (a, b) = (sig(1.0), sig(0.9));
        assert!((r[0][0].1 - 2.5 * a / (a + b)).abs() < 1e-6, "{:?}", r);
        // A bias moves the choice, not the weight: expert 3 becomes group 1's best, group 1
        // wins, and expert 3 is weighted by its own sigmoid score.
        let bias = [0.0, 0.0, 0.0, 5.0];
        let r = route(&scores, 1, &spec, Some(&bias));
        assert_eq!(r[0].iter().map(|c| c.0).collect::<Vec<_>>(), [3, 2]);
        let (c, d) = (sig(-3.0), sig(2.0));
        assert!((r[0][0].1 - 2.5 * c / (c + d)).abs() < 1e-6, "{:?}", r);
    }
}
