//! Picking the next token from logits: greedy, or seeded temperature and
//! top-p sampling whose draw depends only on (seed, position), so that a
//! recomputed step picks the same token.

use crate::batch::Sampling;
use crate::model::weights::SplitMix64;
use crate::ops::argmax;

/// The token after `logits`, produced at sequence position `position`.
pub(crate) fn sample(logits: &[f32], sampling: &Sampling, position: usize) -> u32 {
    if sampling.temperature == 0.0 || logits.is_empty() {
        return argmax(logits) as u32;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / f64::from(sampling.temperature);
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, (f64::from(l - max) * inv_t).exp()))
        .collect();
    // Highest first; ties by token id so the order is a pure function of logits.
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let total: f64 = probs.iter().map(|p| p.1).sum();
    let mut kept = 0;
    let mut mass = 0.0;
    let target = f64::from(sampling.top_p) * total;
    for (_, p) in &probs {
        mass += p;
        kept += 1;
        if mass >= target {
            break;
        }
    }
    let draw = uniform(sampling.seed, position) * mass;
    let mut acc = 0.0;
    for (token, p) in &probs[..kept] {
        acc += p;
        if draw < acc {
            return *token as u32;
        }
    }
    probs[kept - 1].0 as u32
}

/// A uniform draw in [0, 1) that is a pure function of (seed, position).
fn uniform(seed: u64, position: usize) -> f64 {
    let mut rng = SplitMix64::new(seed ^ (position as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    rng.next_u64();
    rng.next_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_p,
            seed,
        }
    }

    #[test]
    fn greedy_is_argmax() {
        assert_eq!(sample(&[0.1, 2.0, -1.0], &Sampling::GREEDY, 5), 1);
    }

    #[test]
    fn draws_are_reproducible_and_vary_with_position() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(1.0, 1.0, 42);
        let a: Vec<u32> = (0..64).map(|pos| sample(&logits, &p, pos)).collect();
        let b: Vec<u32> = (0..64).map(|pos| sample(&logits, &p, pos)).collect();
        assert_eq!(a, b);
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 5, "{distinct:?}");
    }

    #[test]
    fn tiny_top_p_keeps_only_the_best() {
        let logits = [0.0, 5.0, 4.9, 1.0];
        for pos in 0..32 {
            assert_eq!(sample(&logits, &params(1.0, 1e-6, 7), pos), 1);
        }
    }
}
