//! Native engine, CPU backend: a mixture-of-experts MLP over one step's tokens (the MLP half of
//! a decoder layer whose [`crate::config::LayerKind::moe`] is set).
//!
//! The router scores every expert for every token in one product; each token keeps its
//! `top_k` experts, weighted by the softmax of the scores (renormalised over the chosen ones
//! when the config says so). The dispatch is batched by expert, not by token: the rows of
//! every token routed to an expert are gathered into one matrix, the expert's gate, up and down
//! products run once over it, and the weighted rows are added back to their tokens. A decode
//! step of many sequences thus reads each chosen expert's weights once.

use rayon::prelude::*;

use crate::backend::Ffn;
use crate::config::{Activation, Moe};
use crate::weights::Weights;

use super::matmul::Linear;
use super::ops;

/// Each token's chosen experts and their weights, `top_k` per token, best first.
pub fn route(scores: &[f32], t: usize, moe: &Moe) -> Vec<Vec<(usize, f32)>> {
    let e = moe.experts;
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
    router: &Linear,
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
    let groups = by_expert(&route(&scores, t, moe), moe.experts);
    out.fill(0.0);
    let ff = moe.intermediate;
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
            let (mut g, mut u, mut y) = (
                vec![0.0f32; n * ff],
                vec![0.0f32; n * ff],
                vec![0.0f32; n * h],
            );
            let mut scratch = Vec::new();
            expert.gate.forward(w, &xs, n, &mut g, &mut scratch);
            expert.up.forward(w, &xs, n, &mut u, &mut scratch);
            match activation {
                Activation::Silu => ops::silu_mul(&mut g, &u),
                Activation::GeluTanh => ops::gelu_tanh_mul(&mut g, &u),
            }
            expert.down.forward(w, &g, n, &mut y, &mut scratch);
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
        let ff = expert.gate.rows;
        let (mut g, mut u, mut y) = (
            vec![0.0f32; t * ff],
            vec![0.0f32; t * ff],
            vec![0.0f32; t * h],
        );
        expert.gate.forward(w, x, t, &mut g, scratch);
        expert.up.forward(w, x, t, &mut u, scratch);
        match activation {
            Activation::Silu => ops::silu_mul(&mut g, &u),
            Activation::GeluTanh => ops::gelu_tanh_mul(&mut g, &u),
        }
        expert.down.forward(w, &g, t, &mut y, scratch);
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
        let raw = route(&scores, 1, &moe(4, 2, false));
        assert_eq!(raw[0].iter().map(|c| c.0).collect::<Vec<_>>(), [1, 2]);
        assert!((raw[0][0].1 - p[1]).abs() < 1e-6 && (raw[0][1].1 - p[2]).abs() < 1e-6);
        let norm = route(&scores, 1, &moe(4, 2, true));
        let kept = p[1] + p[2];
        assert!((norm[0][0].1 - p[1] / kept).abs() < 1e-6);
        assert!((norm[0][0].1 + norm[0][1].1 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn tokens_are_grouped_by_expert_in_token_order() {
        // Token 0 → experts 1, 0; token 1 → experts 1, 2.
        let scores = [1.0, 3.0, 0.0, 0.0, 3.0, 1.0];
        let groups = by_expert(&route(&scores, 2, &moe(3, 2, true)), 3);
        assert_eq!(groups[0].iter().map(|g| g.0).collect::<Vec<_>>(), [0]);
        assert_eq!(groups[1].iter().map(|g| g.0).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(groups[2].iter().map(|g| g.0).collect::<Vec<_>>(), [1]);
    }
}
