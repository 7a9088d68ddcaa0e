//! Pipelined passes: a Forward sent while the previous one runs. The
//! scheduler names the pass it follows (`ForwardRequest.after_step`) and
//! marks the decode items whose one token is the one that pass sampled
//! (`ForwardSequence.feed_previous`, tokens empty), so it can send pass N+1
//! before pass N's answer is back and the device goes from one pass to the
//! next without waiting for a round trip.
//!
//! [`PassLog`] remembers what the last few passes sampled; the service runs
//! a pass only once the pass it follows is in the log, and fills each fed
//! item's token from it. A pass begun on a device whose tokens are not back
//! yet is in the log as running: the pass that follows it is begun at once,
//! its fed tokens taken on the device from the running pass's argmax rows
//! (the last pass begun there), so the host's work for pass N+1 (checks,
//! metadata, launches) overlaps pass N on the device. A fed item whose
//! sequence the followed pass did not run, or a followed pass that failed
//! before it began, fails the whole request before anything is written: the
//! scheduler's failed-forward path then recomputes or rejects.

use std::collections::{HashMap, VecDeque};

use crate::batch::SeqInput;
use crate::error::{Error, Result, SeqProblem};
use crate::worker::SeqOutput;

/// Passes the log keeps: the scheduler has at most four in flight
/// (`--pipeline-depth`), so the one a pass follows is always among the
/// last few.
const KEPT: usize = 8;

/// One pass the log knows.
#[derive(Debug)]
struct Pass {
    step: u64,
    state: State,
}

#[derive(Debug)]
enum State {
    /// Begun on the device, tokens not back: each sequence's last logit
    /// row, where its sampled token is.
    Running(HashMap<u64, u32>),
    /// Finished: what it sampled per sequence; `None`: it failed.
    Finished(Option<HashMap<u64, u32>>),
}

/// Where a pass's fed tokens come from ([`PassLog::feed`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Fed {
    /// (index into the inputs, logit row of the running pass followed)
    /// of each item fed on the device; empty when the tokens were filled
    /// in from a finished pass.
    pub(crate) on_device: Vec<(usize, u32)>,
}

/// The last few passes, oldest first, and which one was begun last on the
/// device (its argmax rows are there until the next pass begins).
#[derive(Debug, Default)]
pub(crate) struct PassLog {
    recent: VecDeque<Pass>,
    last_begun: Option<u64>,
}

impl PassLog {
    /// Whether the pass of `step` finished (successfully or not) and is
    /// still remembered.
    pub(crate) fn finished(&self, step: u64) -> bool {
        self.find(step)
            .is_some_and(|p| matches!(p.state, State::Finished(_)))
    }

    /// Whether the pass of `step` succeeded, once it finished.
    pub(crate) fn succeeded(&self, step: u64) -> Option<bool> {
        match self.find(step).map(|p| &p.state) {
            Some(State::Finished(sampled)) => Some(sampled.is_some()),
            _ => None,
        }
    }

    /// Whether a pass that follows the pass of `step` can be begun: that
    /// pass finished, or it is the one running last begun on the device.
    pub(crate) fn ready_to_follow(&self, step: u64) -> bool {
        self.finished(step) || self.running_last(step)
    }

    fn running_last(&self, step: u64) -> bool {
        self.last_begun == Some(step)
            && self
                .find(step)
                .is_some_and(|p| matches!(p.state, State::Running(_)))
    }

    fn find(&self, step: u64) -> Option<&Pass> {
        self.recent.iter().find(|p| p.step == step)
    }

    /// Records that a pass of `step` begins on the device with these
    /// (sequence, last logit row) pairs, its tokens not back yet; `None`
    /// for a pass begun that leaves no tokens on the device to feed from.
    pub(crate) fn begun(&mut self, step: u64, rows: Option<HashMap<u64, u32>>) {
        self.last_begun = None;
        if let Some(rows) = rows {
            self.push(step, State::Running(rows));
            self.last_begun = Some(step);
        }
    }

    /// Records that the pass of `step` finished: with its outputs, or
    /// `None` when it failed (a pass that follows it then fails too).
    pub(crate) fn record(&mut self, step: u64, outputs: Option<&[SeqOutput]>) {
        let sampled = outputs.map(|o| o.iter().map(|s| (s.seq_id, s.next_token)).collect());
        self.push(step, State::Finished(sampled));
    }

    fn push(&mut self, step: u64, state: State) {
        self.recent.retain(|p| p.step != step);
        if self.recent.len() == KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(Pass { step, state });
    }

    /// Fills the token of every input that `feed` marks (same order as
    /// `inputs`) with what the pass of `after_step` sampled for its
    /// sequence, or, when that pass is the one running last begun on the
    /// device, names the row each is fed from there (its token a
    /// placeholder). Checks first, writes after: on an error `inputs` is
    /// unchanged.
    pub(crate) fn feed(
        &self,
        after_step: u64,
        inputs: &mut [SeqInput],
        feed: &[bool],
    ) -> Result<Fed> {
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
            return Ok(Fed::default());
        };
        if after_step == 0 {
            return Err(Error::InvalidSequence {
                seq_id: first.seq_id,
                problem: SeqProblem::FeedWithoutAfterStep,
            });
        }
        let previous = |problem: String| Error::PreviousPass {
            step: after_step,
            problem,
        };
        let (by_seq, on_device) = match self.find(after_step).map(|p| &p.state) {
            None => return Err(previous("is not known to this worker".into())),
            Some(State::Finished(None)) => return Err(previous("failed".into())),
            Some(State::Finished(Some(sampled))) => (sampled, false),
            Some(State::Running(rows)) if self.running_last(after_step) => (rows, true),
            Some(State::Running(_)) => {
                return Err(previous(
                    "is still running and another pass was begun after it".into(),
                ));
            }
        };
        let mut values = Vec::new();
        for s in fed() {
            match by_seq.get(&s.seq_id) {
                Some(&v) => values.push(v),
                None => {
                    return Err(previous(format!(
                        "did not run sequence {}, which feeds on it",
                        s.seq_id
                    )));
                }
            }
        }
        let fed_mut = inputs.iter_mut().enumerate().zip(feed).filter(|&(_, &f)| f);
        let mut out = Fed::default();
        for (((index, s), _), v) in fed_mut.zip(values) {
            if on_device {
                // a placeholder the device overwrites before the pass reads it
                s.tokens = vec![0];
                out.on_device.push((index, v));
            } else {
                s.tokens = vec![v];
            }
        }
        Ok(out)
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
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    }

    fn output(seq_id: u64, next_token: u32) -> SeqOutput {
        SeqOutput {
            seq_id,
            next_token,
            argmax: Vec::new(),
            rows: 0..1,
            logprobs: Vec::new(),
        }
    }

    #[test]
    fn a_fed_item_runs_the_token_its_previous_pass_sampled() {
        let mut log = PassLog::default();
        assert!(!log.finished(7));
        log.record(7, Some(&[output(1, 42), output(2, 43)]));
        assert!(log.finished(7));
        let mut inputs = vec![input(2, vec![]), input(3, vec![9]), input(1, vec![])];
        let fed = log.feed(7, &mut inputs, &[true, false, true]).unwrap();
        assert_eq!(fed, Fed::default(), "all from the host");
        let tokens: Vec<_> = inputs.iter().map(|s| s.tokens.clone()).collect();
        assert_eq!(tokens, [vec![43], vec![9], vec![42]]);
    }

    #[test]
    fn a_pass_following_the_running_pass_last_begun_is_fed_its_rows_on_the_device() {
        let mut log = PassLog::default();
        log.begun(7, Some(HashMap::from([(1, 0), (2, 5)])));
        assert!(!log.finished(7) && log.ready_to_follow(7));
        let mut inputs = vec![input(2, vec![]), input(3, vec![9]), input(1, vec![])];
        let fed = log.feed(7, &mut inputs, &[true, false, true]).unwrap();
        assert_eq!(fed.on_device, [(0, 5), (2, 0)]);
        let tokens: Vec<_> = inputs.iter().map(|s| s.tokens.len()).collect();
        assert_eq!(tokens, [1, 1, 1], "fed items hold one placeholder token");
        // its tokens back, it feeds from the host like any finished pass
        log.record(7, Some(&[output(1, 42), output(2, 43)]));
        let mut inputs = vec![input(1, vec![])];
        assert_eq!(log.feed(7, &mut inputs, &[true]).unwrap(), Fed::default());
        assert_eq!(inputs[0].tokens, [42]);
    }

    #[test]
    fn a_running_pass_no_longer_last_begun_cannot_be_followed_yet() {
        let mut log = PassLog::default();
        log.begun(7, Some(HashMap::from([(1, 0)])));
        // a pass begun after it overwrote its rows on the device
        log.begun(8, None);
        assert!(!log.ready_to_follow(7) && !log.ready_to_follow(8));
        let mut inputs = vec![input(1, vec![])];
        let e = log.feed(7, &mut inputs, &[true]).unwrap_err();
        assert!(
            e.to_string().contains("another pass was begun after it"),
            "{e}"
        );
        assert!(inputs[0].tokens.is_empty(), "nothing written");
        log.record(7, Some(&[output(1, 42)]));
        assert!(log.ready_to_follow(7));
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
