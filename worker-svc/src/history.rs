//! The token counts of penalised sequences, kept on the worker so that a
//! decode step sends none (`TokenHistory` in `worker.proto`).
//!
//! A sequence whose sampling has a penalty gets its history once (the
//! tokens before its first pass); from then on the worker counts every
//! token it runs for it, in position order, the fed token of a pipelined
//! decode included. The scheduler never needs to know the latest token.
//! A sequence no pass names for [`IDLE_PASSES`] passes is forgotten (a
//! finished one says nothing); should it come back, the pass fails with
//! FAILED_PRECONDITION and the scheduler recomputes it, history included.

use std::collections::{HashMap, HashSet};

use crate::batch::PlannedSeq;
use crate::error::{Error, Result};

/// Passes after which a sequence no pass named is forgotten.
pub(crate) const IDLE_PASSES: u64 = 1024;

/// One sequence's tokens so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct History {
    /// Distinct tokens of the prompt.
    prompt: HashSet<u32>,
    /// Occurrences of each output token.
    output: HashMap<u32, u32>,
    /// Positions counted: `[0, end)`.
    end: usize,
    /// The pass that last named the sequence.
    last_pass: u64,
}

impl History {
    /// A history of `tokens`, positions `[0, tokens.len())`, of which the
    /// first `prompt_len` are the prompt.
    pub(crate) fn new(tokens: &[u32], prompt_len: usize) -> Self {
        let mut h = History::default();
        h.extend(tokens, prompt_len);
        h
    }

    fn extend(&mut self, tokens: &[u32], prompt_len: usize) {
        for &t in tokens {
            if self.end < prompt_len {
                self.prompt.insert(t);
            } else {
                *self.output.entry(t).or_insert(0) += 1;
            }
            self.end += 1;
        }
    }

    /// Each output token with its count.
    pub(crate) fn output_counts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.output.iter().map(|(&t, &c)| (t, c))
    }

    /// Every token of prompt and output (a token of both, twice).
    pub(crate) fn seen(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompt.iter().chain(self.output.keys()).copied()
    }
}

/// The histories of the penalised sequences this worker runs.
#[derive(Debug, Default)]
pub(crate) struct Histories {
    seqs: HashMap<u64, History>,
    passes: u64,
}

impl Histories {
    /// Counts the tokens of `seqs` (a validated batch) into the histories
    /// of the penalised ones, starting from a sent history where there is
    /// one. Checks every sequence first: on an error nothing changes.
    pub(crate) fn advance(&mut self, seqs: &[PlannedSeq]) -> Result<()> {
        let penalised = || seqs.iter().filter(|s| s.sampling.penalties.any());
        for s in penalised().filter(|s| s.history.is_none()) {
            let problem = match self.seqs.get(&s.seq_id) {
                None => "its penalties need the tokens before it, which this worker does not hold"
                    .to_string(),
                Some(h) if h.end != s.start_pos => format!(
                    "its token counts end at position {} but start_pos is {}",
                    h.end, s.start_pos
                ),
                Some(_) => continue,
            };
            return Err(Error::NoHistory {
                seq_id: s.seq_id,
                problem,
            });
        }
        self.passes += 1;
        for s in penalised() {
            let prompt_len = s.sampling.prompt_len as usize;
            let h = match &s.history {
                Some(tokens) => {
                    let h = self.seqs.entry(s.seq_id).or_default();
                    *h = History::new(tokens, prompt_len);
                    h
                }
                None => self.seqs.entry(s.seq_id).or_default(),
            };
            h.extend(&s.tokens, prompt_len);
            h.last_pass = self.passes;
        }
        let now = self.passes;
        self.seqs.retain(|_, h| now - h.last_pass <= IDLE_PASSES);
        Ok(())
    }

    /// The history of `seq_id`, if kept.
    pub(crate) fn get(&self, seq_id: u64) -> Option<&History> {
        self.seqs.get(&seq_id)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.seqs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{Penalties, Sampling};

    fn seq(seq_id: u64, start_pos: usize, tokens: &[u32], history: Option<Vec<u32>>) -> PlannedSeq {
        PlannedSeq {
            seq_id,
            tokens: tokens.to_vec(),
            start_pos,
            tables: Vec::new(),
            all_positions: false,
            logprobs: None,
            sampling: Sampling {
                penalties: Penalties {
                    presence: 0.5,
                    ..Penalties::NONE
                },
                prompt_len: 3,
                ..Sampling::GREEDY
            },
            copies: Vec::new(),
            history,
            grammar: None,
        }
    }

    fn counts(h: &History) -> Vec<(u32, u32)> {
        let mut v: Vec<(u32, u32)> = h.output_counts().collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn counts_follow_the_passes_from_a_sent_history() {
        let mut h = Histories::default();
        // a reused prefix of 2 prompt tokens, then the prompt's last token
        h.advance(&[seq(1, 2, &[7], Some(vec![5, 5]))]).unwrap();
        h.advance(&[seq(1, 3, &[9], None)]).unwrap();
        h.advance(&[seq(1, 4, &[9], None)]).unwrap();
        let got = h.get(1).unwrap();
        assert_eq!(counts(got), [(9, 2)]);
        let mut seen: Vec<u32> = got.seen().collect();
        seen.sort_unstable();
        assert_eq!(seen, [5, 7, 9]);
        // a recompute sends its history again and starts over
        h.advance(&[seq(1, 4, &[4], Some(vec![5, 5, 7, 9]))])
            .unwrap();
        assert_eq!(counts(h.get(1).unwrap()), [(4, 1), (9, 1)]);
    }

    #[test]
    fn a_missing_or_misplaced_history_fails_the_pass_and_changes_nothing() {
        let mut h = Histories::default();
        h.advance(&[seq(1, 0, &[1, 2, 3], Some(vec![]))]).unwrap();
        let before = h.get(1).cloned();
        let err = h
            .advance(&[seq(1, 3, &[4], None), seq(2, 5, &[1], None)])
            .unwrap_err();
        assert_eq!(
            tonic::Status::from(err).code(),
            tonic::Code::FailedPrecondition
        );
        let err = h.advance(&[seq(1, 7, &[4], None)]).unwrap_err();
        assert!(
            err.to_string()
                .contains("end at position 3 but start_pos is 7"),
            "{err}"
        );
        assert_eq!(h.get(1).cloned(), before);
        // an unpenalised sequence needs none
        let mut plain = seq(3, 9, &[1], None);
        plain.sampling.penalties = Penalties::NONE;
        h.advance(&[plain]).unwrap();
        assert!(h.get(3).is_none());
    }

    #[test]
    fn a_sequence_no_pass_names_is_forgotten() {
        let mut h = Histories::default();
        h.advance(&[seq(1, 0, &[1], Some(vec![]))]).unwrap();
        for i in 0..IDLE_PASSES {
            h.advance(&[seq(2, i as usize, &[1], (i == 0).then(Vec::new))])
                .unwrap();
        }
        assert_eq!(h.len(), 2);
        h.advance(&[seq(2, IDLE_PASSES as usize, &[1], None)])
            .unwrap();
        assert_eq!(h.len(), 1);
        assert!(h.get(1).is_none());
    }
}
