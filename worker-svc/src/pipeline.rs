//! Pipelined passes: a Forward sent while the previous one runs. The
//! scheduler names the pass it follows (`ForwardRequest.after_step`) and
//! marks the decode items whose one token is the one that pass sampled
//! (`ForwardSequence.feed_previous`, tokens empty), so it can send pass N+1
//! before pass N's answer is back and the device goes from one pass to the
//! next without waiting for a round trip.
//!
//! [`PassLog`] remembers what the last few passes sampled; the service runs
//! a pass only once the pass it follows is in the log (finished, whether it
//! succeeded or failed), and fills each fed item's token from it. A fed item
//! whose sequence the followed pass did not run, or a followed pass that
//! failed, fails the whole request before anything is written: the
//! scheduler's failed-forward path then recomputes or rejects.

use std::collections::{HashMap, VecDeque};

use crate::batch::SeqInput;
use crate::error::{Error, Result, SeqProblem};
use crate::worker::SeqOutput;

/// Passes the log keeps: the scheduler has at most two in flight, so the
/// one a pass follows is always among the last few finished.
const KEPT: usize = 8;

/// What one finished pass sampled, per sequence; `None`: it failed.
#[derive(Debug)]
struct Pass {
    step: u64,
    sampled: Option<HashMap<u64, u32>>,
}

/// The last few finished passes, oldest first.
#[derive(Debug, Default)]
pub(crate) struct PassLog {
    recent: VecDeque<Pass>,
}

impl PassLog {
    /// Whether the pass of `step` finished (successfully or not) and is
    /// still remembered.
    pub(crate) fn finished(&self, step: u64) -> bool {
        self.recent.iter().any(|p| p.step == step)
    }

    /// Records that the pass of `step` finished: with its outputs, or
    /// `None` when it failed (a pass that follows it then fails too).
    pub(crate) fn record(&mut self, step: u64, outputs: Option<&[SeqOutput]>) {
        let sampled = outputs.map(|o| o.iter().map(|s| (s.seq_id, s.next_token)).collect());
        self.recent.retain(|p| p.step != step);
        if self.recent.len() == KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(Pass { step, sampled });
    }

    /// Fills the token of every input that `feed` marks (same order as
    /// `inputs`) with what the pass of `after_step` sampled for its
    /// sequence. Checks first, writes after: on an error `inputs` is
    /// unchanged.
    pub(crate) fn feed(
        &self,
        after_step: u64,
        inputs: &mut [SeqInput],
        feed: &[bool],
    ) -> Result<()> {
        let fed = || inputs.iter().zip(feed).filter(|&(_, &f)| f).map(|(s, _)| s);
        if let Some(s) = fed().find(|s| !s.tokens.is_empty()) {
            return Err(Error::InvalidSequence {
                seq_id: s.seq_id,
                problem: SeqProblem::FeedWithTokens {
                    tokens: s.tokens.len(),
                },
            });
        }
        let Some(first) = fed().next() else {
            return Ok(());
        };
        if after_step == 0 {
            return Err(Error::InvalidSequence {
                seq_id: first.seq_id,
                problem: SeqProblem::FeedWithoutAfterStep,
            });
        }
        let pass = self.recent.iter().find(|p| p.step == after_step);
        let sampled = match pass {
            None => {
                return Err(Error::PreviousPass {
                    step: after_step,
                    problem: "is not known to this worker".into(),
                });
            }
            Some(Pass { sampled: None, .. }) => {
                return Err(Error::PreviousPass {
                    step: after_step,
                    problem: "failed".into(),
                });
            }
            Some(Pass {
                sampled: Some(sampled),
                ..
            }) => sampled,
        };
        let mut tokens = Vec::new();
        for s in fed() {
            match sampled.get(&s.seq_id) {
                Some(&t) => tokens.push(t),
                None => {
                    return Err(Error::PreviousPass {
                        step: after_step,
                        problem: format!("did not run sequence {}, which feeds on it", s.seq_id),
                    });
                }
            }
        }
        let fed_mut = inputs.iter_mut().zip(feed).filter(|&(_, &f)| f);
        for ((s, _), t) in fed_mut.zip(tokens) {
            s.tokens = vec![t];
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Sampling;

    fn input(seq_id: u64, tokens: Vec<u32>) -> SeqInput {
        SeqInput {
            seq_id,
            tokens,
            start_pos: 5,
            tables: Vec::new(),
            all_positions: false,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
        }
    }

    fn output(seq_id: u64, next_token: u32) -> SeqOutput {
        SeqOutput {
            seq_id,
            next_token,
            argmax: Vec::new(),
            rows: 0..1,
        }
    }

    #[test]
    fn a_fed_item_runs_the_token_its_previous_pass_sampled() {
        let mut log = PassLog::default();
        assert!(!log.finished(7));
        log.record(7, Some(&[output(1, 42), output(2, 43)]));
        assert!(log.finished(7));
        let mut inputs = vec![input(2, vec![]), input(3, vec![9]), input(1, vec![])];
        log.feed(7, &mut inputs, &[true, false, true]).unwrap();
        let tokens: Vec<_> = inputs.iter().map(|s| s.tokens.clone()).collect();
        assert_eq!(tokens, [vec![43], vec![9], vec![42]]);
    }

    #[test]
    fn nothing_fed_needs_no_previous_pass() {
        let log = PassLog::default();
        let mut inputs = vec![input(1, vec![4])];
        log.feed(0, &mut inputs, &[false]).unwrap();
        log.feed(99, &mut inputs, &[false]).unwrap();
        assert_eq!(inputs[0].tokens, [4]);
    }

    #[test]
    fn a_missing_failed_or_unknown_previous_pass_fails_the_request_and_changes_nothing() {
        let mut log = PassLog::default();
        log.record(7, Some(&[output(1, 42)]));
        log.record(8, None);
        let mut inputs = vec![input(1, vec![]), input(2, vec![])];
        let err = |log: &PassLog, after, inputs: &mut Vec<SeqInput>| {
            log.feed(after, inputs, &[true, true])
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err(&log, 7, &mut inputs),
            "the pass of step 7 this pass follows did not run sequence 2, which feeds on it"
        );
        assert_eq!(
            err(&log, 8, &mut inputs),
            "the pass of step 8 this pass follows failed"
        );
        assert_eq!(
            err(&log, 9, &mut inputs),
            "the pass of step 9 this pass follows is not known to this worker"
        );
        assert!(
            inputs.iter().all(|s| s.tokens.is_empty()),
            "nothing written"
        );
        let status = tonic::Status::from(log.feed(8, &mut inputs, &[true, true]).unwrap_err());
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn a_malformed_fed_item_is_invalid_argument_naming_it() {
        let mut log = PassLog::default();
        log.record(7, Some(&[output(1, 42)]));
        let mut with_tokens = vec![input(1, vec![5])];
        let e = log.feed(7, &mut with_tokens, &[true]).unwrap_err();
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
        let mut no_step = vec![input(1, vec![])];
        let e = log.feed(0, &mut no_step, &[true]).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("sequence 1: feed_previous is set but the request's after_step is 0"),
            "{e}"
        );
    }

    #[test]
    fn the_log_keeps_the_last_passes_and_a_step_recorded_again_replaces_its_entry() {
        let mut log = PassLog::default();
        for step in 1..=20 {
            log.record(step, Some(&[output(1, step as u32)]));
        }
        assert!(!log.finished(20 - KEPT as u64));
        assert!(log.finished(21 - KEPT as u64) && log.finished(20));
        log.record(20, None);
        let mut inputs = vec![input(1, vec![])];
        assert!(log.feed(20, &mut inputs, &[true]).is_err());
        assert!(log.feed(19, &mut inputs, &[true]).is_ok());
        assert_eq!(inputs[0].tokens, [19]);
    }
}
