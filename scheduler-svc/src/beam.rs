//! Beam search's choices, in plain code: which continuations of the live
//! beams survive a step, which end as hypotheses, when the search is done,
//! and how the hypotheses rank. The core (`step::beams`) applies them to
//! sequences and leases.
//!
//! The rule is transformers' `num_beams` with `length_penalty` 1.0 and
//! `early_stopping=False`, over the model's raw log-softmax:
//! - each step, every live beam offers its `2 * width` most likely next
//!   tokens (the worker's top logprobs of its row); the candidates are
//!   ranked by cumulative logprob (ties: the better beam, then the lower
//!   token id) and the best `2 * width` are looked at in that order;
//! - a candidate that is a stop token (the model's end ids, `stop_tokens`)
//!   becomes a finished hypothesis if it ranks among the first `width`;
//!   the first `width` other candidates are the next step's beams, except
//!   that one reaching `max_tokens` becomes a finished hypothesis instead;
//! - a hypothesis scores its cumulative logprob divided by its length (the
//!   generated tokens, a stop token included); the `width` best are kept;
//! - the search is done when no beam is live, or when `width` hypotheses
//!   are kept and the best live beam's cumulative logprob divided by its
//!   length does not beat the worst of them.

/// Most beams a request may ask for: the worker reports at most 20
/// alternatives per row, `2 * width` per beam.
pub const MAX_BEAM_WIDTH: u32 = 10;

/// Alternatives each beam's row must report.
pub fn candidates_per_beam(width: u32) -> u32 {
    2 * width
}

/// A live beam, as a step's selection sees it.
#[derive(Debug, Clone, Copy)]
pub struct Live<'a> {
    /// Cumulative logprob of its generated tokens.
    pub logprob: f64,
    /// Tokens it generated.
    pub generated: usize,
    /// Its row's most likely next tokens (token, logprob), best first.
    pub row: &'a [(u32, f32)],
}

/// A continuation a step chose: of beam `beam` (an index into the beams
/// given to [`select`]) by `token`, with the new cumulative logprob.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Continuation {
    pub beam: usize,
    pub token: u32,
    pub logprob: f64,
}

/// What one step of the search chose.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    /// The next step's beams, the best first.
    pub live: Vec<Continuation>,
    /// Continuations that end: `true` at a stop token, `false` at
    /// `max_tokens`.
    pub ended: Vec<(Continuation, bool)>,
}

/// One step: the continuations of `beams` that survive or end.
pub fn select(width: u32, beams: &[Live<'_>], stop: &[u32], max_tokens: u32) -> Selection {
    let width = width as usize;
    let mut all: Vec<Continuation> = beams
        .iter()
        .enumerate()
        .flat_map(|(beam, b)| {
            b.row
                .iter()
                .take(2 * width)
                .filter(|(_, lp)| lp.is_finite())
                .map(move |&(token, lp)| Continuation {
                    beam,
                    token,
                    logprob: b.logprob + f64::from(lp),
                })
        })
        .collect();
    all.sort_by(|a, b| {
        b.logprob
            .total_cmp(&a.logprob)
            .then(a.beam.cmp(&b.beam))
            .then(a.token.cmp(&b.token))
    });
    let mut out = Selection::default();
    for (rank, c) in all.into_iter().take(2 * width).enumerate() {
        if out.live.len() + out.ended.iter().filter(|e| !e.1).count() >= width {
            break;
        }
        if stop.contains(&c.token) {
            if rank < width {
                out.ended.push((c, true));
            }
            continue;
        }
        if beams[c.beam].generated + 1 >= max_tokens as usize {
            out.ended.push((c, false));
        } else {
            out.live.push(c);
        }
    }
    out
}

/// A finished hypothesis.
#[derive(Debug, Clone, PartialEq)]
pub struct Hypothesis {
    /// Its generated tokens.
    pub tokens: Vec<u32>,
    /// Cumulative logprob.
    pub logprob: f64,
    /// Ended at a stop token (else at `max_tokens`).
    pub stopped: bool,
}

impl Hypothesis {
    /// Its rank score: the cumulative logprob over its length.
    pub fn score(&self) -> f64 {
        score(self.logprob, self.tokens.len())
    }
}

fn score(logprob: f64, len: usize) -> f64 {
    logprob / (len.max(1) as f64)
}

/// The best `width` hypotheses so far.
#[derive(Debug, Clone, Default)]
pub struct Hypotheses {
    width: usize,
    list: Vec<Hypothesis>,
}

impl Hypotheses {
    pub fn new(width: u32) -> Self {
        Self {
            width: width as usize,
            list: Vec::new(),
        }
    }

    /// Keeps `h` if it is among the best `width` (an equal score does not
    /// displace an earlier one).
    pub fn add(&mut self, h: Hypothesis) {
        if self.list.len() < self.width || h.score() > self.worst() {
            self.list.push(h);
            if self.list.len() > self.width
                && let Some(i) = self.worst_index()
            {
                self.list.remove(i);
            }
        }
    }

    fn worst_index(&self) -> Option<usize> {
        // the worst score; of equals, the latest
        (0..self.list.len()).rev().min_by(|&a, &b| {
            self.list[a]
                .score()
                .total_cmp(&self.list[b].score())
                .then(b.cmp(&a))
        })
    }

    fn worst(&self) -> f64 {
        self.worst_index()
            .map_or(f64::NEG_INFINITY, |i| self.list[i].score())
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Whether the search is done, with `best_live` the best live beam's
    /// (cumulative logprob, length), `None` when no beam is live.
    pub fn is_done(&self, best_live: Option<(f64, usize)>) -> bool {
        match best_live {
            None => true,
            Some((logprob, len)) => {
                self.list.len() >= self.width && self.worst() >= score(logprob, len)
            }
        }
    }

    /// The hypotheses, the best first (of equal scores, the earlier kept).
    pub fn ranked(mut self) -> Vec<Hypothesis> {
        // a stable sort keeps the order they were kept in among equals
        self.list.sort_by(|a, b| b.score().total_cmp(&a.score()));
        self.list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(logprob: f64, generated: usize, row: &[(u32, f32)]) -> Live<'_> {
        Live {
            logprob,
            generated,
            row,
        }
    }

    #[test]
    fn the_best_continuations_by_cumulative_logprob_survive() {
        let a = [(1, -0.1), (2, -2.0), (3, -3.0), (4, -4.0)];
        let b = [(5, -0.2), (6, -0.3), (7, -5.0), (8, -6.0)];
        // beam b starts worse but its second token beats a's second
        let s = select(2, &[live(-1.0, 1, &a), live(-1.5, 1, &b)], &[], 100);
        let picked: Vec<(usize, u32)> = s.live.iter().map(|c| (c.beam, c.token)).collect();
        assert_eq!(picked, vec![(0, 1), (1, 5)]);
        assert!((s.live[1].logprob - -1.7).abs() < 1e-6);
        assert!(s.ended.is_empty());
    }

    #[test]
    fn a_stop_token_ends_a_hypothesis_only_among_the_first_width() {
        let a = [(9, -0.1), (1, -0.2), (2, -0.3), (9, -9.0)];
        let s = select(2, &[live(0.0, 0, &a)], &[9], 100);
        assert_eq!(s.ended.len(), 1);
        assert_eq!((s.ended[0].0.token, s.ended[0].1), (9, true));
        // the stop token does not take a beam's place
        let picked: Vec<u32> = s.live.iter().map(|c| c.token).collect();
        assert_eq!(picked, vec![1, 2]);
        // ranked below width: dropped
        let b = [(1, -0.1), (2, -0.2), (9, -0.3)];
        let s = select(2, &[live(0.0, 0, &b)], &[9], 100);
        assert!(s.ended.is_empty());
    }

    #[test]
    fn max_tokens_ends_every_continuation() {
        let a = [(1, -0.1), (2, -0.2), (3, -0.3)];
        let s = select(2, &[live(0.0, 3, &a)], &[], 4);
        assert!(s.live.is_empty());
        let ended: Vec<(u32, bool)> = s.ended.iter().map(|(c, st)| (c.token, *st)).collect();
        assert_eq!(ended, vec![(1, false), (2, false)]);
    }

    #[test]
    fn ties_go_to_the_better_beam_then_the_lower_token() {
        let a = [(7, -1.0), (3, -1.0)];
        let b = [(1, -1.0)];
        let s = select(2, &[live(0.0, 1, &a), live(0.0, 1, &b)], &[], 100);
        let picked: Vec<(usize, u32)> = s.live.iter().map(|c| (c.beam, c.token)).collect();
        assert_eq!(picked, vec![(0, 3), (0, 7)]);
    }

    #[test]
    fn hypotheses_keep_the_best_width_by_length_normalised_score() {
        let h = |n: usize, logprob: f64| Hypothesis {
            tokens: vec![0; n],
            logprob,
            stopped: true,
        };
        let mut hs = Hypotheses::new(2);
        hs.add(h(1, -1.0)); // -1.0
        hs.add(h(4, -2.0)); // -0.5
        assert!(!hs.is_done(Some((-0.1, 1))));
        hs.add(h(2, -4.0)); // -2.0: worse than both, not kept
        assert_eq!(hs.len(), 2);
        hs.add(h(3, -1.5)); // -0.5: displaces -1.0
        // the worst kept is -0.5: a live beam at -2.0 over 2 tokens cannot beat it
        assert!(hs.is_done(Some((-2.0, 2))));
        assert!(!hs.is_done(Some((-0.9, 2))));
        assert!(hs.is_done(None));
        let ranked = hs.ranked();
        assert_eq!(ranked.len(), 2);
        assert_eq!(
            ranked.iter().map(|h| h.tokens.len()).collect::<Vec<_>>(),
            vec![4, 3],
            "equal scores: the earlier kept first"
        );
    }
}
