//! Log-probabilities of a logits row: the chosen token's and the `top`
//! most likely alternatives, the one definition the CPU follows here and
//! the CUDA kernel `logprob_rows` follows on the device.
//!
//! They are of the model's raw distribution, `log_softmax` of the logits
//! as the forward pass returns them: before `logit_bias`, penalties,
//! `min_tokens`, temperature, the top-k/top-p/min-p cuts (vLLM's
//! default, `raw_logprobs`) and a grammar's mask. So they do not depend on
//! how the token was picked, and a reference forward pass gives the same
//! numbers.
//!
//! `logprob(t) = (l_t - max) - ln(sum_i exp(l_i - max))`: `l - max` in
//! f32, the exponentials, their sum and the logarithm in f64, the result
//! rounded to f32. NaN logits are left out of the sum and of the top list.
//! The top list is ordered by logprob, descending, ties by token id
//! ascending (the order of [`crate::sampling::key`], then the id).

use crate::batch::PlannedSeq;
use crate::error::{Error, Result};
use crate::logits::BatchLogits;
use crate::sampling::key;

pub use crate::batch::MAX_TOP_LOGPROBS as MAX_TOP;

/// What one logits row of a pass should report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobRow {
    /// The row among the pass's logits rows.
    pub row: usize,
    /// Alternatives, at most [`MAX_TOP`].
    pub top: usize,
    /// The token whose logprob is reported; `None`: the token the pass
    /// picks at this row (sampled or argmax).
    pub chosen: Option<u32>,
}

/// The log-probabilities of one row.
#[derive(Debug, Clone, PartialEq)]
pub struct RowLogprobs {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// (token, logprob) of the most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// The rows of a pass `seqs` ask for, in batch order: `first_row` is the
/// sequence's first logits row. With `prompt` every row, row `i` choosing
/// `tokens[i + 1]`; the last row chooses `next_prompt_token`, else the
/// picked token.
pub(crate) fn rows_of(seq: &PlannedSeq, first_row: usize) -> Vec<LogprobRow> {
    let Some(spec) = seq.logprobs else {
        return Vec::new();
    };
    let top = spec.top as usize;
    let n = seq.logit_rows();
    let last = LogprobRow {
        row: first_row + n - 1,
        top,
        chosen: spec.next_prompt_token,
    };
    if n == 1 || !spec.prompt {
        // the last row only (drafts' rows, `all_positions`, report nothing)
        return vec![last];
    }
    // every input position has a row (`logit_rows`)
    let mut rows: Vec<LogprobRow> = (0..n - 1)
        .map(|i| LogprobRow {
            row: first_row + i,
            top,
            chosen: seq.tokens.get(i + 1).copied(),
        })
        .collect();
    rows.push(last);
    rows
}

/// The logprobs `rows` ask of `logits`, the tokens picked at its rows
/// being `picked`: how a backend whose logits are on the host answers
/// [`crate::backend::Backend::forward_picks`].
pub fn batch_logprobs(
    logits: &BatchLogits,
    picked: &[u32],
    rows: &[LogprobRow],
) -> Result<Vec<RowLogprobs>> {
    let vocab = logits.vocab.max(1);
    rows.iter()
        .map(|r| {
            let row = logits.values.chunks_exact(vocab).nth(r.row);
            let chosen = r.chosen.or_else(|| picked.get(r.row).copied());
            match (row, chosen) {
                (Some(row), Some(chosen)) => Ok(row_logprobs(row, chosen, r.top)),
                _ => Err(Error::Backend(format!(
                    "logprobs of row {} (the pass has {} rows)",
                    r.row,
                    picked.len()
                ))),
            }
        })
        .collect()
}

/// `max` and `ln(sum_i exp(l_i - max))` of a row, NaN left out; `None`
/// when no logit is a number.
fn normalizer(row: &[f32]) -> Option<(f32, f64)> {
    let max = row
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        // every logit -inf or NaN: no distribution to speak of
        return row.iter().any(|l| !l.is_nan()).then_some((max, 0.0));
    }
    let sum: f64 = row
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    Some((max, sum.ln()))
}

/// The log-probability of logit `l` under a row's `(max, ln_sum)`.
fn logprob((max, ln_sum): (f32, f64), l: f32) -> f32 {
    if max == f32::NEG_INFINITY || l.is_nan() {
        return f32::NEG_INFINITY;
    }
    (f64::from(l - max) - ln_sum) as f32
}

/// The logprob of `chosen` and of the `top` most likely tokens of `row`
/// (fewer when the row has fewer numbers); a `chosen` outside the row
/// gets -inf.
pub fn row_logprobs(row: &[f32], chosen: u32, top: usize) -> RowLogprobs {
    let Some(norm) = normalizer(row) else {
        return RowLogprobs {
            token: chosen,
            logprob: f32::NEG_INFINITY,
            top: Vec::new(),
        };
    };
    let best = top_tokens(row, top.min(MAX_TOP));
    RowLogprobs {
        token: chosen,
        logprob: row
            .get(chosen as usize)
            .map_or(f32::NEG_INFINITY, |&l| logprob(norm, l)),
        top: best
            .into_iter()
            .map(|t| (t, logprob(norm, row[t as usize])))
            .collect(),
    }
}

/// The `k` largest logits' tokens, largest first, ties by lower id; NaN
/// never among them.
fn top_tokens(row: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    // (key, !id): larger is better, then lower id
    let rank = |t: usize| (u64::from(key(row[t])) << 32) | u64::from(!(t as u32));
    let mut ranked: Vec<u64> = (0..row.len())
        .filter(|&t| !row[t].is_nan())
        .map(rank)
        .collect();
    let k = k.min(ranked.len());
    if k == 0 {
        return Vec::new();
    }
    ranked.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    ranked.truncate(k);
    ranked.sort_unstable_by(|a, b| b.cmp(a));
    ranked.into_iter().map(|r| !(r as u32)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// log_softmax written the plain way, in f64 throughout.
    fn plain_log_softmax(row: &[f32]) -> Vec<f64> {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
        row.iter().map(|&l| l as f64 - max - sum.ln()).collect()
    }

    fn wavy(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.37).sin() * 4.0 + 30.0)
            .collect()
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_row() {
        let row = wavy(500);
        let reference = plain_log_softmax(&row);
        for t in [0u32, 17, 499] {
            let got = row_logprobs(&row, t, 0);
            assert!((got.logprob as f64 - reference[t as usize]).abs() < 1e-5);
            assert!(got.top.is_empty());
        }
        // the whole distribution sums to one
        let all = row_logprobs(&row, 0, MAX_TOP);
        let mass: f64 = reference.iter().map(|l| l.exp()).sum();
        assert!((mass - 1.0).abs() < 1e-9);
        assert!(all.top.iter().map(|t| (t.1 as f64).exp()).sum::<f64>() <= 1.0);
    }

    #[test]
    fn top_is_sorted_the_most_likely_first_ties_by_id() {
        let row = [1.0, 3.0, 2.0, 3.0, f32::NAN, -1.0];
        let got = row_logprobs(&row, 5, 4);
        let tokens: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(tokens, [1, 3, 2, 0]);
        assert!(got.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert_eq!(got.top[0].1, got.top[1].1);
        // the chosen token's logprob is the one the top list gives it
        let chosen = row_logprobs(&row, 2, 4);
        assert_eq!(chosen.logprob, chosen.top[2].1);
        // NaN is never listed and leaves the rest a distribution
        let everything = row_logprobs(&row, 4, MAX_TOP);
        assert_eq!(everything.top.len(), 5);
        assert_eq!(everything.logprob, f32::NEG_INFINITY);
        let mass: f32 = everything.top.iter().map(|t| t.1.exp()).sum();
        assert!((mass - 1.0).abs() < 1e-6, "{mass}");
    }

    #[test]
    fn top_is_capped_and_the_argmax_comes_first() {
        let row = wavy(100);
        let got = row_logprobs(&row, 0, 50);
        assert_eq!(got.top.len(), MAX_TOP);
        assert_eq!(got.top[0].0 as usize, crate::ops::argmax(&row));
        assert!(got.top.iter().all(|t| t.1 <= 0.0));
        let mut sorted: Vec<f32> = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        for (i, (t, _)) in got.top.iter().enumerate() {
            assert_eq!(row[*t as usize], sorted[i]);
        }
    }

    #[test]
    fn large_logits_do_not_overflow_and_banned_tokens_are_minus_infinity() {
        let row = [1e30, 1e30, f32::NEG_INFINITY];
        let got = row_logprobs(&row, 2, 3);
        assert_eq!(got.logprob, f32::NEG_INFINITY);
        assert!((got.top[0].1 - (0.5f32).ln()).abs() < 1e-6);
        // a row of nothing but -inf (or NaN) has no distribution
        let none = row_logprobs(&[f32::NAN, f32::NAN], 0, 2);
        assert_eq!(none.logprob, f32::NEG_INFINITY);
        assert!(none.top.is_empty());
        // a chosen token outside the vocabulary
        assert_eq!(row_logprobs(&row, 9, 0).logprob, f32::NEG_INFINITY);
    }
}
