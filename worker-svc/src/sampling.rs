//! Picking the next token from a logits row, the one definition the CPU
//! follows here and the CUDA kernels (`sample_rows`, `adjust_logits`)
//! follow on the device.
//!
//! 1. Adjust ([`Adjust`], built on the host from the sequence's sampling and
//!    history): add `logit_bias`; -inf for the stop ids while `min_tokens`
//!    holds them back; HF's repetition penalty over prompt and output
//!    tokens (a positive logit divided, a negative one multiplied); minus
//!    `frequency × count + presence` over output tokens.
//!    Then the grammar's mask of a constrained sequence (`grammar.rs`):
//!    -inf for every token it does not allow next.
//! 2. Temperature 0: the argmax of the adjusted row.
//! 3. Otherwise `p(l) = exp((l - max) / T)` in f64 (`l - max` in f32), and a
//!    token is kept when its logit is among the `top_k` largest (ties at the
//!    k-th kept), `p >= min_p`, and within the `top_p` nucleus of what those
//!    keep: the largest logit `v` whose kept tokens `>= v` hold at least
//!    `top_p` of the kept mass is the cut (ties kept). Logits are compared
//!    through [`key`], so the order is total and the same on both sides.
//! 4. The draw `u(seed, position)` in [0, 1) times the kept mass, walked in
//!    token-id order: the first kept token whose running sum exceeds it
//!    (the last kept one if rounding leaves it unreached). The draw depends
//!    only on (seed, position), so a recomputed step, in any batch, picks
//!    the same token.

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::batch::Sampling;
use crate::history::History;
use crate::logits::BatchLogits;
use crate::model::weights::SplitMix64;
use crate::ops::argmax;

/// A change to one token's logit before temperature: `l + bias`, then the
/// repetition penalty, then `- penalty`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adjust {
    /// The token.
    pub token: u32,
    /// Added first (`logit_bias`; -inf bans).
    pub bias: f32,
    /// Divides a positive logit, multiplies a negative one; 1 = none.
    pub repetition: f32,
    /// Subtracted last (frequency and presence).
    pub penalty: f32,
}

impl Adjust {
    fn new(token: u32) -> Self {
        Adjust {
            token,
            bias: 0.0,
            repetition: 1.0,
            penalty: 0.0,
        }
    }

    /// The adjusted logit (the CUDA `adjust_logits` computes the same, in f32).
    pub fn apply(&self, logit: f32) -> f32 {
        let l = logit + self.bias;
        let l = if l > 0.0 {
            l / self.repetition
        } else {
            l * self.repetition
        };
        l - self.penalty
    }
}

/// How one logits row becomes a token, when not by its plain argmax.
#[derive(Debug, Clone, PartialEq)]
pub struct RowPick {
    /// The row among the batch's logits rows.
    pub row: usize,
    /// 0: the argmax of the adjusted row.
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// In (0, 1].
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// The uniform draw in [0, 1) for this (seed, position).
    pub draw: f64,
    /// Ascending by token, each token once.
    pub adjusts: Vec<Adjust>,
    /// A constrained sequence's allowed tokens: bit `t % 32` of word
    /// `t / 32`, `vocab.div_ceil(32)` words (the CUDA `mask_logits` reads
    /// the same); the others get -inf after the adjustments.
    pub mask: Option<Vec<u32>>,
}

/// How `row`, holding the logits of a token at `position` of a sequence
/// with `sampling` (and `history`, when it has penalties; `mask`, when it is
/// constrained), becomes a token; `None` when that is its plain argmax.
pub(crate) fn row_pick(
    row: usize,
    sampling: &Sampling,
    history: Option<&History>,
    position: usize,
    mask: Option<Vec<u32>>,
) -> Option<RowPick> {
    // by token: each token once, in the order the device expects
    let mut adjusts: BTreeMap<u32, Adjust> = sampling
        .logit_bias
        .iter()
        .map(|&(token, bias)| {
            let a = Adjust {
                bias,
                ..Adjust::new(token)
            };
            (token, a)
        })
        .collect();
    if position < sampling.prompt_len as usize + sampling.min_tokens as usize {
        for &t in &sampling.stop_ids {
            at(&mut adjusts, t).bias = f32::NEG_INFINITY;
        }
    }
    let p = sampling.penalties;
    if let Some(h) = history.filter(|_| p.any()) {
        if p.repetition != 1.0 {
            for t in h.seen() {
                at(&mut adjusts, t).repetition = p.repetition;
            }
        }
        if p.frequency != 0.0 || p.presence != 0.0 {
            for (t, count) in h.output_counts() {
                at(&mut adjusts, t).penalty = p.frequency * count as f32 + p.presence;
            }
        }
    }
    if sampling.temperature == 0.0 && adjusts.is_empty() && mask.is_none() {
        return None;
    }
    Some(RowPick {
        row,
        temperature: sampling.temperature,
        top_k: sampling.top_k,
        top_p: sampling.top_p,
        min_p: sampling.min_p,
        draw: uniform(sampling.seed, position),
        adjusts: adjusts.into_values().collect(),
        mask,
    })
}

/// The adjustment of token `t`, a new one if it has none.
fn at(adjusts: &mut BTreeMap<u32, Adjust>, t: u32) -> &mut Adjust {
    adjusts.entry(t).or_insert_with(|| Adjust::new(t))
}

/// The token of every row of `logits`: the pick's where `picks` has one,
/// else the argmax.
pub fn pick_rows(logits: &BatchLogits, picks: &[RowPick]) -> Vec<u32> {
    let vocab = logits.vocab.max(1);
    let mut tokens: Vec<u32> = logits
        .values
        .chunks_exact(vocab)
        .map(|r| argmax(r) as u32)
        .collect();
    for p in picks {
        if let Some(row) = logits.values.chunks_exact(vocab).nth(p.row) {
            tokens[p.row] = pick(row, p);
        }
    }
    tokens
}

/// The token `p` picks from the raw logits `row`.
pub fn pick(row: &[f32], p: &RowPick) -> u32 {
    let row: Cow<'_, [f32]> = if p.adjusts.is_empty() && p.mask.is_none() {
        Cow::Borrowed(row)
    } else {
        let mut r = row.to_vec();
        for a in &p.adjusts {
            if let Some(l) = r.get_mut(a.token as usize) {
                *l = a.apply(*l);
            }
        }
        if let Some(mask) = &p.mask {
            apply_mask(&mut r, mask);
        }
        Cow::Owned(r)
    };
    if p.temperature == 0.0 {
        return argmax(&row) as u32;
    }
    sample(&row, p)
}

/// -inf for every logit of `row` whose bit in `mask` is clear (a token
/// past the mask's words is clear too), as the CUDA `mask_logits` does.
pub fn apply_mask(row: &mut [f32], mask: &[u32]) {
    for (t, l) in row.iter_mut().enumerate() {
        let on = mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
        if !on {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// The total order logits are compared in: larger logit, larger key
/// (-0.0 below +0.0); NaN is never kept, whatever its key.
pub fn key(l: f32) -> u32 {
    let bits = l.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// Steps 3 and 4 of the module doc on an adjusted row.
fn sample(row: &[f32], p: &RowPick) -> u32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY || max.is_nan() {
        // every token banned (or no number at all): as greedy would
        return argmax(row) as u32;
    }
    let inv_t = 1.0 / f64::from(p.temperature);
    let prob = |l: f32| (f64::from(l - max) * inv_t).exp();
    let mut cut = 0u32;
    if p.top_k > 0 && (p.top_k as usize) < row.len() {
        let mut keys: Vec<u32> = row
            .iter()
            .filter(|l| !l.is_nan())
            .map(|&l| key(l))
            .collect();
        let k = p.top_k as usize;
        if k <= keys.len() {
            let (_, kth, _) = keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
            cut = *kth;
        }
    }
    let min_p = f64::from(p.min_p);
    let kept = |l: f32, cut: u32| !l.is_nan() && key(l) >= cut && prob(l) >= min_p;
    if p.top_p < 1.0 {
        let mut nucleus: Vec<(u32, f64)> = row
            .iter()
            .filter(|&&l| kept(l, cut))
            .map(|&l| (key(l), prob(l)))
            .collect();
        let target = f64::from(p.top_p) * nucleus.iter().map(|x| x.1).sum::<f64>();
        nucleus.sort_unstable_by_key(|x| std::cmp::Reverse(x.0));
        let mut mass = 0.0;
        let mut i = 0;
        while i < nucleus.len() {
            let k = nucleus[i].0;
            while i < nucleus.len() && nucleus[i].0 == k {
                mass += nucleus[i].1;
                i += 1;
            }
            if mass >= target {
                cut = cut.max(k);
                break;
            }
        }
    }
    let mass: f64 = row
        .iter()
        .filter(|&&l| kept(l, cut))
        .map(|&l| prob(l))
        .sum();
    let draw = p.draw * mass;
    let mut acc = 0.0;
    let mut last = 0;
    for (token, &l) in row.iter().enumerate() {
        if kept(l, cut) {
            acc += prob(l);
            last = token;
            if acc > draw {
                return token as u32;
            }
        }
    }
    last as u32
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
    use crate::batch::Penalties;

    fn sampled(temperature: f32, top_p: f32, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_p,
            seed,
            ..Sampling::GREEDY
        }
    }

    /// The token `sampling` picks from `logits` at `position`.
    fn next(logits: &[f32], s: &Sampling, history: Option<&History>, position: usize) -> u32 {
        match row_pick(0, s, history, position, None) {
            Some(p) => pick(logits, &p),
            None => argmax(logits) as u32,
        }
    }

    fn wavy(n: usize) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.37).sin() * 2.0).collect()
    }

    /// Tokens drawn at positions `0..n`.
    fn draws(logits: &[f32], s: &Sampling, n: usize) -> Vec<u32> {
        (0..n).map(|pos| next(logits, s, None, pos)).collect()
    }

    #[test]
    fn greedy_is_argmax_and_needs_no_pick() {
        assert_eq!(row_pick(0, &Sampling::GREEDY, None, 5, None), None);
        assert_eq!(next(&[0.1, 2.0, -1.0], &Sampling::GREEDY, None, 5), 1);
    }

    #[test]
    fn draws_are_reproducible_and_vary_with_position() {
        let logits = wavy(50);
        let p = sampled(1.0, 1.0, 42);
        let a = draws(&logits, &p, 64);
        assert_eq!(a, draws(&logits, &p, 64));
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 5, "{distinct:?}");
    }

    #[test]
    fn tiny_top_p_keeps_only_the_best() {
        let logits = [0.0, 5.0, 4.9, 1.0];
        assert!(
            draws(&logits, &sampled(1.0, 1e-6, 7), 32)
                .iter()
                .all(|&t| t == 1)
        );
    }

    #[test]
    fn top_k_one_equals_greedy_and_top_k_bounds_the_choices() {
        let logits = wavy(60);
        let best = argmax(&logits) as u32;
        let k1 = Sampling {
            top_k: 1,
            ..sampled(5.0, 1.0, 3)
        };
        assert!(draws(&logits, &k1, 64).iter().all(|&t| t == best));
        let k3 = Sampling { top_k: 3, ..k1 };
        let mut order: Vec<u32> = (0..60).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let got: std::collections::HashSet<u32> = draws(&logits, &k3, 200).into_iter().collect();
        let top3: std::collections::HashSet<u32> = order[..3].iter().copied().collect();
        assert_eq!(got, top3, "a hot temperature reaches all three and no more");
    }

    #[test]
    fn min_p_drops_tokens_far_below_the_best() {
        // probabilities relative to the best at T = 1: 1, e^-1, e^-3, e^-3
        let logits = [3.0, 2.0, 0.0, 0.0];
        let s = Sampling {
            min_p: 0.2,
            ..sampled(1.0, 1.0, 11)
        };
        let got: std::collections::HashSet<u32> = draws(&logits, &s, 300).into_iter().collect();
        assert_eq!(got, [0, 1].into_iter().collect());
        let all: std::collections::HashSet<u32> = draws(&logits, &sampled(1.0, 1.0, 11), 300)
            .into_iter()
            .collect();
        assert_eq!(all.len(), 4, "without min_p every token comes up");
    }

    #[test]
    fn a_logit_bias_of_minus_100_bans_the_token_greedy_would_pick() {
        let logits = wavy(40);
        let best = argmax(&logits) as u32;
        let ban = |s: Sampling| Sampling {
            logit_bias: vec![(best, -100.0)],
            ..s
        };
        assert_ne!(next(&logits, &ban(Sampling::GREEDY), None, 3), best);
        assert!(!draws(&logits, &ban(sampled(2.0, 1.0, 5)), 200).contains(&best));
        // and a positive one makes a token the greedy choice
        let boost = Sampling {
            logit_bias: vec![(7, 100.0)],
            ..Sampling::GREEDY
        };
        assert_eq!(next(&logits, &boost, None, 3), 7);
    }

    #[test]
    fn min_tokens_holds_the_stop_ids_back_until_reached() {
        let logits = [0.0, 1.0, 9.0];
        let s = Sampling {
            prompt_len: 4,
            min_tokens: 2,
            stop_ids: vec![2],
            ..Sampling::GREEDY
        };
        // positions 4 and 5 are the first two outputs
        assert_eq!(next(&logits, &s, None, 4), 1);
        assert_eq!(next(&logits, &s, None, 5), 1);
        assert_eq!(next(&logits, &s, None, 6), 2);
    }

    #[test]
    fn penalties_lower_tokens_already_generated() {
        let logits = [2.0, 1.9, 1.8, -1.0];
        // prompt [3], output [0, 0, 1]
        let h = History::new(&[3, 0, 0, 1], 1);
        let with = |penalties: Penalties| Sampling {
            penalties,
            prompt_len: 1,
            ..Sampling::GREEDY
        };
        let freq = with(Penalties {
            frequency: 0.1,
            ..Penalties::NONE
        });
        // token 0 (twice in the output) loses 0.2, token 1 (once) 0.1
        let adjusted: Vec<f32> = {
            let p = row_pick(0, &freq, Some(&h), 4, None).unwrap();
            let mut r = logits.to_vec();
            for a in &p.adjusts {
                r[a.token as usize] = a.apply(r[a.token as usize]);
            }
            r
        };
        assert!((adjusted[0] - 1.8).abs() < 1e-6 && (adjusted[1] - 1.8).abs() < 1e-6);
        let presence = with(Penalties {
            presence: 0.5,
            ..Penalties::NONE
        });
        assert_eq!(next(&logits, &presence, Some(&h), 4), 2);
        // repetition: the prompt's token 3 (negative) goes further down,
        // the output's tokens 0 and 1 are divided
        let rep = with(Penalties {
            repetition: 2.0,
            ..Penalties::NONE
        });
        let p = row_pick(0, &rep, Some(&h), 4, None).unwrap();
        let tokens: Vec<u32> = p.adjusts.iter().map(|a| a.token).collect();
        assert_eq!(tokens, [0, 1, 3]);
        assert_eq!(p.adjusts[2].apply(-1.0), -2.0);
        assert_eq!(p.adjusts[0].apply(2.0), 1.0);
        assert_eq!(next(&logits, &rep, Some(&h), 4), 2);
        // sampled, a penalty makes repeats rarer
        let hot = |penalties: Penalties| Sampling {
            temperature: 1.0,
            seed: 9,
            ..with(penalties)
        };
        let repeats = |s: &Sampling| {
            (0..400)
                .filter(|&pos| next(&logits, s, Some(&h), pos) < 2)
                .count()
        };
        let plain = repeats(&hot(Penalties::NONE));
        let penalised = repeats(&hot(Penalties {
            frequency: 1.0,
            ..Penalties::NONE
        }));
        assert!(
            penalised < plain,
            "{penalised} repeats with the penalty, {plain} without"
        );
    }

    #[test]
    fn a_mask_leaves_only_its_tokens_greedy_or_sampled() {
        let logits = wavy(70);
        let best = argmax(&logits) as u32;
        // tokens 3, 40 and 65 allowed (the third word reaches past 64)
        let mut mask = vec![0u32; 3];
        for t in [3usize, 40, 65] {
            mask[t / 32] |= 1 << (t % 32);
        }
        assert!(![3, 40, 65].contains(&best));
        let greedy = row_pick(0, &Sampling::GREEDY, None, 0, Some(mask.clone()))
            .expect("a mask makes a pick even for greedy");
        let allowed = [3, 40, 65];
        let by_logit = *allowed
            .iter()
            .max_by(|&&a, &&b| logits[a as usize].total_cmp(&logits[b as usize]))
            .unwrap();
        assert_eq!(pick(&logits, &greedy), by_logit);
        let hot = sampled(5.0, 1.0, 21);
        let got: std::collections::HashSet<u32> = (0..300)
            .map(|pos| {
                pick(
                    &logits,
                    &row_pick(0, &hot, None, pos, Some(mask.clone())).unwrap(),
                )
            })
            .collect();
        assert_eq!(
            got,
            allowed.into_iter().collect(),
            "all three and nothing else"
        );
        // a mask with a bias: the bias moves the choice among allowed tokens only
        let biased = Sampling {
            logit_bias: vec![(best, 100.0), (65, 50.0)],
            ..Sampling::GREEDY
        };
        let p = row_pick(0, &biased, None, 0, Some(mask)).unwrap();
        assert_eq!(pick(&logits, &p), 65);
    }

    #[test]
    fn keys_order_like_the_logits() {
        let values = [
            f32::NEG_INFINITY,
            -3.5,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in values.windows(2) {
            assert!(key(w[0]) < key(w[1]), "{w:?}");
        }
    }
}
