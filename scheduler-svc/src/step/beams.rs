//! Beam search on the fork machinery: which beams continue, fork, end or
//! are pruned each step (the choices are `crate::beam`'s), and the answer.
//!
//! A beam request is admitted as one sequence (the root). Every pass of a
//! beam asks the worker for its row's `2 * width` most likely tokens and
//! the worker's own pick is thrown away: a beam is fed only the token the
//! search chose, never the device's pick (a beam decode is never planned
//! behind a pass in flight, so it never sets `feed_previous`). Once every
//! live beam of a request has its row (and no fork of it waits), the
//! search steps:
//! - a beam's best surviving continuation goes on in place (its token is
//!   appended to its context; its next decode feeds it);
//! - its other surviving continuations fork from it (`Lease.fork_of`): the
//!   branch's context is the parent's with its own last token, which the
//!   fork computes; the cache shares the parent's blocks before it and
//!   copies the block holding it on write;
//! - a beam with no surviving continuation is pruned: released, fenced as
//!   any release;
//! - continuations that end become hypotheses; when the search is done,
//!   every beam left is released and the request answers its best `n`
//!   hypotheses (index = rank), each with its cumulative logprob.
//!
//! Running out of blocks drops a beam rather than preempting the request:
//! a refused fork drops that candidate, a beam whose lease cannot grow (or
//! whose worker failed) ends, and the search goes on with the others.
//! Under a reserving policy (`GUARANTEED_NO_EVICT`, `STATIC_BATCH`) the
//! request's admission reserved every beam, so a fork refused for
//! exhaustion waits for the fences of the beams pruned before it instead
//! (its parent held), and the search stays exact. A
//! request left with no beam and fewer than `n` hypotheses answers the
//! missing ranks with the refusal (`REJECTED`, the cache's reason) or the
//! error. Before the search starts (the root's prompt), the root is an
//! ordinary sequence: preempted and requeued as any.

use std::collections::HashMap;

use super::{Core, Fork};
use crate::beam::{self, Hypotheses, Hypothesis, Live};
use crate::domain::{Finish, ItemLogprobs, Output, RequestId, SeqId, TokenLogprob};
use crate::queue::Request;

/// A request's beam search.
#[derive(Debug)]
pub(super) struct BeamSearch {
    width: u32,
    /// Hypotheses the request answers.
    n: u32,
    /// Whether the first selection ran (the root's prompt is done).
    started: bool,
    hypotheses: Hypotheses,
    /// Why the last dropped beam ended (a refusal, a failed pass), for
    /// the ranks no hypothesis fills.
    dropped: Option<Finish>,
    /// The request as submitted, to start over after a lost cache session.
    root: Request,
    /// The root's reused and retained prompt tokens, reported with rank 0.
    reused: Option<(u32, u32)>,
}

impl Core {
    /// Starts the search state of a beam request (`n` hypotheses answered).
    pub(super) fn open_beams(&mut self, request: &Request, n: u32) {
        self.beams.insert(
            request.id,
            BeamSearch {
                width: request.beam_width,
                n: n.clamp(1, request.beam_width),
                started: false,
                hypotheses: Hypotheses::new(request.beam_width),
                dropped: None,
                root: request.clone(),
                reused: None,
            },
        );
    }

    /// A beam's pass returned: its row waits for the search's step; the
    /// worker's pick is not used.
    pub(super) fn beam_row(&mut self, seq_id: SeqId, mut logprobs: Vec<TokenLogprob>) {
        let Some(seq) = self.running.get_mut(&seq_id) else {
            return;
        };
        let Some(row) = logprobs.pop() else {
            self.end_sequence(
                seq_id,
                Finish::Error("worker returned no logprobs for a beam".into()),
            );
            return;
        };
        seq.beam_row = Some(row.top);
        if !seq.request.reported_reuse {
            seq.request.reported_reuse = true;
            let reused = (seq.reused_tokens, seq.request.retained_tokens);
            if let Some(search) = self.beams.get_mut(&seq.request.id) {
                search.reused = Some(reused);
            }
        }
    }

    /// What a beam's pass asks the worker's logprobs for: the row of its
    /// last position (a decode's, the last prefill chunk's).
    pub(super) fn beam_item_logprobs(
        request: &Request,
        end: usize,
        context_len: usize,
    ) -> Option<ItemLogprobs> {
        (end >= context_len).then(|| ItemLogprobs {
            top: beam::candidates_per_beam(request.beam_width),
            prompt: false,
            next_prompt_token: None,
        })
    }

    /// A started beam ends without a hypothesis (its fork refused, its lease
    /// unable to grow, its pass failed): released; the search goes on.
    pub(super) fn drop_beam(&mut self, seq_id: SeqId, why: Finish) {
        let Some(seq) = self.running.remove(&seq_id) else {
            return;
        };
        self.release_ended(&seq);
        self.beam_dropped(seq.request.id, why);
    }

    /// A candidate or beam of `id` was dropped for `why`.
    pub(super) fn beam_dropped(&mut self, id: RequestId, why: Finish) {
        tracing::debug!(request = id.get(), ?why, "beam dropped");
        if let Some(search) = self.beams.get_mut(&id) {
            search.dropped = Some(why);
        }
    }

    /// Steps every search whose beams all have their rows.
    pub(super) fn advance_beams(&mut self) {
        let ready: Vec<RequestId> = self
            .beams
            .iter()
            .filter(|(id, search)| self.beams_ready(**id, search.started))
            .map(|(id, _)| *id)
            .collect();
        for id in ready {
            self.step_beams(id);
        }
    }

    fn beams_ready(&self, id: RequestId, started: bool) -> bool {
        if self.forks.iter().any(|f| f.request.id == id)
            || self.leasing.iter().any(|l| l.request.id == id)
        {
            return false;
        }
        let mut any = false;
        for s in self.running.values().filter(|s| s.request.id == id) {
            if s.beam_row.is_none() || !s.in_flight.is_empty() || s.planned.is_some() {
                return false;
            }
            any = true;
        }
        any || started
    }

    /// One step of the search of `id` (see the module documentation).
    fn step_beams(&mut self, id: RequestId) {
        // the beams, the best first (ties: the older sequence)
        let mut ids: Vec<SeqId> = self
            .running
            .values()
            .filter(|s| s.request.id == id)
            .map(|s| s.seq_id)
            .collect();
        ids.sort_by(|a, b| {
            let (a, b) = (&self.running[a], &self.running[b]);
            b.request
                .beam_logprob
                .total_cmp(&a.request.beam_logprob)
                .then(a.seq_id.cmp(&b.seq_id))
        });
        let Some(search) = self.beams.get_mut(&id) else {
            return;
        };
        search.started = true;
        let selection = match ids.first().map(|s| &self.running[s].request) {
            Some(first) => {
                let lives: Vec<Live<'_>> = ids
                    .iter()
                    .map(|s| {
                        let seq = &self.running[s];
                        Live {
                            logprob: seq.request.beam_logprob,
                            generated: seq.request.generated.len(),
                            row: seq.beam_row.as_deref().unwrap_or(&[]),
                        }
                    })
                    .collect();
                beam::select(search.width, &lives, &first.stop_tokens, first.max_tokens)
            }
            None => beam::Selection::default(),
        };
        for (c, stopped) in &selection.ended {
            let mut tokens = self.running[&ids[c.beam]].request.generated.clone();
            tokens.push(c.token);
            search.hypotheses.add(Hypothesis {
                tokens,
                logprob: c.logprob,
                stopped: *stopped,
            });
        }
        let best_live = selection.live.first().map(|c| {
            (
                c.logprob,
                self.running[&ids[c.beam]].request.generated.len() + 1,
            )
        });
        if search.hypotheses.is_done(best_live) {
            self.end_beams(id, None);
            return;
        }
        let mut children: HashMap<usize, Vec<beam::Continuation>> = HashMap::new();
        for c in selection.live {
            children.entry(c.beam).or_default().push(c);
        }
        for (i, seq_id) in ids.into_iter().enumerate() {
            let Some(cs) = children.remove(&i) else {
                // pruned
                if let Some(seq) = self.running.remove(&seq_id) {
                    self.release_ended(&seq);
                }
                continue;
            };
            let Some(seq) = self.running.get_mut(&seq_id) else {
                continue;
            };
            let parent = seq.request.clone();
            for c in &cs[1..] {
                let mut child = parent.clone();
                child.generated.push(c.token);
                child.beam_logprob = c.logprob;
                // the root reports the prompt's reuse; the parent holds the
                // retained prompt
                child.retain = None;
                child.retained_tokens = 0;
                child.queued_at = None;
                child.last_refusal = None;
                self.forks.push(Fork {
                    parent: seq_id,
                    group: seq.group,
                    request: child,
                });
            }
            let c = cs[0];
            seq.context.push(c.token);
            seq.request.generated.push(c.token);
            seq.request.beam_logprob = c.logprob;
            seq.beam_row = None;
        }
    }

    /// Ends the search of `id`: every beam left is released; the request
    /// answers its best `n` hypotheses (`why` `None`), or ends every rank
    /// with `why`. A request already answered is left alone.
    pub(super) fn end_beams(&mut self, id: RequestId, why: Option<Finish>) {
        let Some(search) = self.beams.remove(&id) else {
            return;
        };
        let beams: Vec<SeqId> = self
            .running
            .values()
            .filter(|s| s.request.id == id)
            .map(|s| s.seq_id)
            .collect();
        let mut preemptions = search.root.preemptions;
        for seq_id in beams {
            if let Some(seq) = self.running.remove(&seq_id) {
                preemptions = preemptions.max(seq.request.preemptions);
                self.release_ended(&seq);
            }
        }
        self.forks.retain(|f| f.request.id != id);
        if self.leasing.iter().any(|l| l.request.id == id) {
            // answered now: the grant is released when it comes
            self.cancelled_leasing.insert(id);
        }
        let ranked = match why {
            Some(_) => Vec::new(),
            None => search.hypotheses.ranked(),
        };
        let short = why.or(search.dropped).unwrap_or_else(|| {
            Finish::Error("beam search ended with fewer hypotheses than n".into())
        });
        let mut ranked = ranked.into_iter();
        for index in 0..search.n {
            let (finish, cumulative_logprob) = match ranked.next() {
                Some(h) => {
                    self.outputs.push(Output::Tokens {
                        request: id,
                        index,
                        tokens: h.tokens,
                        reused_tokens: (index == 0).then_some(search.reused).flatten(),
                        logprobs: Vec::new(),
                        prompt_logprobs: None,
                    });
                    let finish = if h.stopped {
                        Finish::Stop
                    } else {
                        Finish::Length
                    };
                    (finish, Some(h.logprob as f32))
                }
                None => (short.clone(), None),
            };
            self.count_finish(&finish);
            self.outputs.push(Output::Finished {
                request: id,
                index,
                finish,
                preemptions,
                last: index + 1 == search.n,
                cumulative_logprob,
            });
        }
    }

    /// The cache lost every lease: started searches start over from their
    /// prompt (`recompute`), the search being deterministic, or end with
    /// `why`. Their beams are gone from `running` and `forks` after it.
    pub(super) fn beams_lost(&mut self, recompute: bool, why: &Finish) {
        let started: Vec<RequestId> = self
            .beams
            .iter()
            .filter(|(_, s)| s.started)
            .map(|(id, _)| *id)
            .collect();
        for id in started {
            let seqs: Vec<SeqId> = self
                .running
                .values()
                .filter(|s| s.request.id == id)
                .map(|s| s.seq_id)
                .collect();
            for seq_id in seqs {
                self.running.remove(&seq_id);
                self.released.push(seq_id);
            }
            self.forks.retain(|f| f.request.id != id);
            if recompute {
                if let Some(search) = self.beams.get_mut(&id) {
                    search.started = false;
                    search.hypotheses = Hypotheses::new(search.width);
                    search.dropped = None;
                    let mut root = search.root.clone();
                    root.preemptions += 1;
                    self.queue.requeue(root);
                }
            } else {
                self.end_beams(id, Some(why.clone()));
            }
        }
    }
}
