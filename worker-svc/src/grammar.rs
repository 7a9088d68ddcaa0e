//! The matchers of constrained sequences (structured output), kept on the
//! worker between passes like the penalised sequences' token counts
//! (`history.rs`), so that a decode step sends no grammar and the mask of
//! step N+1 is built here, once token N is known, even when the scheduler
//! sent pass N+1 before pass N's answer came back.
//!
//! A constrained sequence brings its grammar (`kvlease_tokenizer::grammar`)
//! and its history on its first pass: the worker compiles it against the
//! model's vocabulary and replays the history's output tokens (positions
//! from `prompt_len`). From then on it feeds the matcher every output token
//! it runs for the sequence, in position order, the fed token of a
//! pipelined decode included (the service waits for the pass it follows to
//! come back first: the host must know the token), and asks it for the
//! mask of the sequence's next token, one bit per model token. A matcher
//! that ran the end token (the fed token of a pass sent before the end came
//! back) is dropped at once; a sequence no pass names for [`IDLE_PASSES`]
//! passes (one that ended by length, a stop string or a cancel) is
//! forgotten; should it come back the pass fails with FAILED_PRECONDITION
//! and the scheduler recomputes it, grammar included.

use std::collections::HashMap;

use kvlease_tokenizer::Tokenizer;
use kvlease_tokenizer::grammar::Matcher;

use crate::batch::PlannedSeq;
use crate::error::{Error, Result, SeqProblem};
use crate::history::IDLE_PASSES;

/// One constrained sequence's place in its grammar.
#[derive(Debug)]
struct Kept {
    matcher: Matcher,
    /// Positions fed: `[0, end)` (the prompt's are skipped).
    end: usize,
    /// The pass that last named the sequence.
    last_pass: u64,
}

/// The matchers of the constrained sequences this worker runs.
#[derive(Debug, Default)]
pub(crate) struct Matchers {
    /// The model's tokenizer, whose vocabulary grammars compile against;
    /// `None` until the service hands it over (a constrained sequence is
    /// refused before).
    tokenizer: Option<Tokenizer>,
    seqs: HashMap<u64, Kept>,
    passes: u64,
}

impl Matchers {
    /// Grammars compile against `tokenizer`'s vocabulary.
    pub(crate) fn set_tokenizer(&mut self, tokenizer: Tokenizer) {
        self.tokenizer = Some(tokenizer);
        self.seqs.clear();
    }

    /// Feeds the tokens of `seqs` (a validated batch) to the constrained
    /// sequences' matchers, compiling those whose grammar the batch sends.
    /// Checks every sequence and compiles every grammar first: on those
    /// errors nothing changes. A token a matcher refuses (never one the
    /// worker sampled under its mask) drops that matcher and fails the pass.
    pub(crate) fn advance(&mut self, seqs: &[PlannedSeq]) -> Result<()> {
        let constrained = || seqs.iter().filter(|s| s.sampling.constrained);
        for s in constrained().filter(|s| s.grammar.is_none()) {
            let problem = match self.seqs.get(&s.seq_id) {
                None => "its grammar's matcher is not on this worker".to_string(),
                Some(k) if k.end != s.start_pos => format!(
                    "its matcher ends at position {} but start_pos is {}",
                    k.end, s.start_pos
                ),
                Some(_) => continue,
            };
            return Err(Error::NoGrammar {
                seq_id: s.seq_id,
                problem,
            });
        }
        let mut fresh = Vec::new();
        for s in constrained() {
            let Some(constraint) = &s.grammar else {
                continue;
            };
            let bad = |problem: String| Error::InvalidSequence {
                seq_id: s.seq_id,
                problem: SeqProblem::BadGrammar(problem),
            };
            let tokenizer = self
                .tokenizer
                .as_ref()
                .ok_or_else(|| bad("this worker has no tokenizer to compile it with".into()))?;
            let grammars = tokenizer.grammars().map_err(bad)?;
            let matcher = grammars
                .compile(constraint)
                .map_err(|e| bad(e.to_string()))?;
            fresh.push((s.seq_id, matcher));
        }
        self.passes += 1;
        for (seq_id, matcher) in fresh {
            let kept = Kept {
                matcher,
                end: 0,
                last_pass: self.passes,
            };
            self.seqs.insert(seq_id, kept);
        }
        for s in constrained() {
            let prompt_len = s.sampling.prompt_len as usize;
            let replay = s.grammar.as_ref().and(s.history.as_deref());
            let tokens = replay.unwrap_or(&[]).iter().chain(&s.tokens);
            let from = if replay.is_some() { 0 } else { s.start_pos };
            let Some(kept) = self.seqs.get_mut(&s.seq_id) else {
                continue;
            };
            let mut refused = None;
            for (pos, &t) in (from..).zip(tokens) {
                if pos >= prompt_len
                    && let Err(e) = kept.matcher.consume(t)
                {
                    refused = Some(format!("token {t} at position {pos}: {e}"));
                    break;
                }
            }
            if let Some(problem) = refused {
                self.seqs.remove(&s.seq_id);
                return Err(Error::NoGrammar {
                    seq_id: s.seq_id,
                    problem,
                });
            }
            kept.end = s.start_pos + s.tokens.len();
            kept.last_pass = self.passes;
            if kept.matcher.ended() {
                // The end token ran (a pipelined pass sent before the end
                // came back): no later pass names the sequence.
                self.seqs.remove(&s.seq_id);
            }
        }
        let now = self.passes;
        self.seqs.retain(|_, k| now - k.last_pass <= IDLE_PASSES);
        Ok(())
    }

    /// The mask of `seq_id`'s next token over a model vocabulary of
    /// `vocab` tokens (`vocab / 32` words rounded up, a bit per allowed
    /// token); `None` when the sequence is not constrained here.
    pub(crate) fn mask(&mut self, seq_id: u64, vocab: usize) -> Result<Option<Vec<u32>>> {
        let Some(kept) = self.seqs.get_mut(&seq_id) else {
            return Ok(None);
        };
        let mut words = Vec::new();
        kept.matcher
            .mask_into(&mut words, vocab)
            .map_err(|problem| Error::NoGrammar { seq_id, problem })?;
        Ok(Some(words))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.seqs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Sampling;
    use kvlease_tokenizer::byte_level::EOS;
    use kvlease_tokenizer::grammar::{Constraint, allowed};

    fn seq(
        seq_id: u64,
        start_pos: usize,
        tokens: &[u8],
        sent: Option<(&str, Vec<u32>)>,
    ) -> PlannedSeq {
        let (grammar, history) = match sent {
            Some((rx, h)) => (Some(Constraint::Regex(rx.into())), Some(h)),
            None => (None, None),
        };
        PlannedSeq {
            seq_id,
            tokens: tokens.iter().map(|&b| u32::from(b)).collect(),
            start_pos,
            tables: Vec::new(),
            all_positions: false,
            sampling: Sampling {
                constrained: true,
                prompt_len: 2,
                ..Sampling::GREEDY
            },
            copies: Vec::new(),
            history,
            grammar,
            logprobs: None,
        }
    }

    fn matchers() -> Matchers {
        let mut m = Matchers::default();
        m.set_tokenizer(Tokenizer::byte_level());
        m
    }

    /// The tokens `seq_id`'s mask allows over the byte vocabulary.
    fn next(m: &mut Matchers, seq_id: u64) -> Vec<u32> {
        let words = m.mask(seq_id, 258).unwrap().unwrap();
        (0..258).filter(|&t| allowed(&words, t)).collect()
    }

    #[test]
    fn the_mask_follows_the_outputs_from_a_sent_grammar_and_history() {
        let mut m = matchers();
        // prompt "pq" (not fed to the matcher), then outputs
        m.advance(&[seq(1, 0, b"pq", Some(("abc|abd", vec![])))])
            .unwrap();
        assert_eq!(next(&mut m, 1), [u32::from(b'a')]);
        m.advance(&[seq(1, 2, b"a", None)]).unwrap();
        m.advance(&[seq(1, 3, b"b", None)]).unwrap();
        assert_eq!(next(&mut m, 1), [u32::from(b'c'), u32::from(b'd')]);
        m.advance(&[seq(1, 4, b"d", None)]).unwrap();
        assert_eq!(next(&mut m, 1), [EOS], "complete: only the end");
        // a pipelined pass that runs the end token: the matcher is dropped
        // (no later pass names the sequence) and the row goes unmasked
        m.advance(&[PlannedSeq {
            tokens: vec![EOS],
            ..seq(1, 5, b"", None)
        }])
        .unwrap();
        assert_eq!(m.mask(1, 258).unwrap(), None);
        // a recompute sends grammar and history again and replays the outputs
        m.advance(&[seq(
            1,
            3,
            b"b",
            Some(("abc|abd", b"pqa".map(u32::from).to_vec())),
        )])
        .unwrap();
        assert_eq!(next(&mut m, 1), [u32::from(b'c'), u32::from(b'd')]);
        assert_eq!(m.mask(2, 258).unwrap(), None, "unconstrained: no mask");
    }

    #[test]
    fn a_missing_misplaced_or_bad_grammar_fails_the_pass_and_changes_nothing() {
        let mut m = matchers();
        m.advance(&[seq(1, 0, b"pq", Some(("ab", vec![])))])
            .unwrap();
        let err = m
            .advance(&[seq(1, 2, b"a", None), seq(2, 5, b"a", None)])
            .unwrap_err();
        assert_eq!(
            tonic::Status::from(err).code(),
            tonic::Code::FailedPrecondition
        );
        let err = m.advance(&[seq(1, 7, b"a", None)]).unwrap_err();
        assert!(
            err.to_string()
                .contains("ends at position 2 but start_pos is 7"),
            "{err}"
        );
        let err = m
            .advance(&[seq(1, 2, b"a", None), seq(3, 0, b"pq", Some(("(", vec![])))])
            .unwrap_err();
        assert_eq!(
            tonic::Status::from(err).code(),
            tonic::Code::InvalidArgument
        );
        assert!(
            err_text(&m),
            "nothing changed: sequence 1 still at position 2"
        );
        m.advance(&[seq(1, 2, b"a", None)]).unwrap();
        // a token the grammar refuses drops the matcher
        let err = m.advance(&[seq(1, 3, b"x", None)]).unwrap_err();
        assert!(err.to_string().contains("token 120 at position 3"), "{err}");
        assert_eq!(m.len(), 0);
    }

    fn err_text(m: &Matchers) -> bool {
        m.seqs.get(&1).is_some_and(|k| k.end == 2)
    }

    #[test]
    fn a_sequence_no_pass_names_is_forgotten() {
        let mut m = matchers();
        m.advance(&[seq(1, 0, b"pq", Some(("a*", vec![])))])
            .unwrap();
        m.advance(&[seq(2, 0, b"pq", Some(("a*", vec![])))])
            .unwrap();
        for i in 0..IDLE_PASSES {
            m.advance(&[seq(2, 2 + i as usize, b"a", None)]).unwrap();
        }
        assert_eq!(m.len(), 1);
        assert_eq!(m.mask(1, 258).unwrap(), None);
    }
}
