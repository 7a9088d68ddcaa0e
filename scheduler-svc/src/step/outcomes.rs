//! Outcomes: the running sequences' work for the step (extends, forward
//! batches) and what the Extend outcomes and forward results mean for them.

use std::collections::HashMap;
use std::time::Instant;

use super::{Core, PreemptCause, WORKER_RETRY_AFTER, Work};
use crate::domain::{
    ExtendSpec, Finish, ForwardAnswer, ForwardItem, ItemLogprobs, Outcome, Output, Reject,
    RejectReason, SeqId, Step, TokenLogprob,
};
use crate::policy::{OnExhausted, Policy};
use crate::queue::Request;
use crate::spec;

impl Core {
    /// Plans the running sequences' work for this step (decode first, then
    /// prefill chunks) and returns the extends it needs, with a progress
    /// report for each prefill chunk after a sequence's first.
    ///
    /// `ahead` false: every decode is planned, and its extend must be
    /// answered before the pass launches (a decode the cache did not grow
    /// does not run). `ahead` true (the overlap order with a pass in
    /// flight): a decode runs only if its step fits in the slots its lease
    /// already covers, and its extend, which reports the fed token and
    /// grows the lease a step ahead (the lookahead slots), is sent after
    /// the launch; a decode without room sits this step out, and its extend
    /// grows the lease for the next.
    pub fn plan_extends(&mut self, ahead: bool) -> Vec<ExtendSpec> {
        if ahead && self.config.order.is_pipelined() {
            return self.plan_pipelined();
        }
        let mut extends = Vec::new();
        let draft_k = self.config.draft_k;
        for seq in self.running.values_mut() {
            // a prefill group's sequence decodes where it is handed off
            if !seq.decoding()
                || !seq.in_flight.is_empty()
                || seq.planned.is_some()
                || seq.handoff.is_some()
            {
                continue;
            }
            // a beam waiting for its search's step has no token to feed
            if seq.context.len() <= seq.kv_len as usize {
                continue;
            }
            let budget = &mut self.budget[seq.group];
            if *budget == 0 {
                continue;
            }
            let from = seq.cache_len as usize;
            let to = seq.kv_len as usize + 1;
            let report = ExtendSpec {
                seq_id: seq.seq_id,
                new_tokens: seq.context[from.min(to)..to].to_vec(),
                written_tokens: 0,
                from_length: seq.cache_len,
            };
            seq.reporting = to as u32;
            // slots past this decode's own that the lease covers (the
            // cache's length is a floor: it always covers its tokens)
            let spare = if ahead {
                let covered = seq.capacity.max(seq.cache_len);
                match covered.checked_sub(seq.kv_len + 1) {
                    Some(spare) => spare,
                    None => {
                        // no room: the extend grows the lease for the next step
                        extends.push(report);
                        continue;
                    }
                }
            } else {
                u32::MAX
            };
            let remaining = seq.request.remaining();
            let room = (*budget - 1)
                .min(remaining.saturating_sub(1))
                .min(seq.extra.draft)
                .min(spare);
            let drafts = if draft_k > 0 && room > 0 {
                spec::draft(&seq.context[..=seq.kv_len as usize], room as usize)
            } else {
                Vec::new()
            };
            *budget -= 1 + drafts.len() as u32;
            if !report.new_tokens.is_empty() {
                extends.push(report);
            }
            seq.planned = Some(Work::Decode { drafts });
        }
        let chunk_limit = self.config.prefill_chunk.max(1);
        for seq in self.running.values_mut() {
            if seq.decoding() || !seq.in_flight.is_empty() || seq.planned.is_some() {
                continue;
            }
            let budget = &mut self.budget[seq.group];
            let len = chunk_limit.min(seq.lease_len - seq.kv_len).min(*budget);
            if len > 0 {
                *budget -= len;
                seq.planned = Some(Work::Prefill { len });
                // This step's pass writes the chunk: the cache publishes the
                // prompt blocks it completes once the step completes (the
                // lease's step covered only the first chunk).
                extends.push(ExtendSpec {
                    seq_id: seq.seq_id,
                    new_tokens: Vec::new(),
                    written_tokens: seq.kv_len + len,
                    // a progress report grows nothing: not checked
                    from_length: 0,
                });
            }
        }
        extends
    }

    /// The pipelined order's plan ([`super::Order::Pipelined`], `plan_extends(true)`):
    /// each sequence's next pass starts where its passes in flight (fewer
    /// than the order's depth) will leave it. A decode runs if the slots its
    /// lease covers hold its position and it has tokens left to make after
    /// what is in flight; with a pass in flight it feeds the token that pass
    /// samples, which must be the pass its group's next one follows. A
    /// prefill chunk continues from the last one in flight.
    /// Returns the chunks' progress reports; the decodes' extends are
    /// planned at the settle ([`Core::settle_extends`]), once the collected
    /// pass told their tokens.
    fn plan_pipelined(&mut self) -> Vec<ExtendSpec> {
        let depth = self.config.order.depth();
        // the pass each group's next one follows: the worker feeds a decode
        // only from that pass, so a sequence that sat it out (a pipeline
        // deeper than two) waits until its own passes are back
        let follows: Vec<Option<Step>> = (0..self.groups.len()).map(|g| self.follows(g)).collect();
        let mut extends = Vec::new();
        for seq in self.running.values_mut() {
            if seq.in_flight.len() >= depth
                || seq.planned.is_some()
                || (seq.pulling && !seq.in_flight.is_empty())
            {
                continue;
            }
            if let Some(&(newest, _)) = seq.in_flight.back()
                && follows.get(seq.group).copied().flatten() != Some(newest)
            {
                continue;
            }
            let ahead = seq.ahead();
            if ahead.kv_len < seq.lease_len || seq.handoff.is_some() {
                continue;
            }
            // a beam is fed only the token its search chose: never behind
            // a pass in flight (which would feed the worker's own pick)
            let beam = seq.request.beam_width > 1;
            if beam && (!seq.in_flight.is_empty() || seq.context.len() <= seq.kv_len as usize) {
                continue;
            }
            let budget = &mut self.budget[seq.group];
            let covered = seq.capacity.max(seq.cache_len);
            if *budget == 0 || seq.request.remaining() <= ahead.emits || covered <= ahead.kv_len {
                // no budget, nothing left to make, or no room: the settle's
                // extend grows the lease for a later step
                continue;
            }
            *budget -= 1;
            seq.planned = Some(Work::Decode { drafts: Vec::new() });
        }
        let chunk_limit = self.config.prefill_chunk.max(1);
        for seq in self.running.values_mut() {
            if seq.in_flight.len() >= depth
                || seq.planned.is_some()
                || (seq.pulling && !seq.in_flight.is_empty())
            {
                continue;
            }
            let ahead = seq.ahead();
            if ahead.kv_len >= seq.lease_len {
                continue;
            }
            let budget = &mut self.budget[seq.group];
            let len = chunk_limit.min(seq.lease_len - ahead.kv_len).min(*budget);
            if len > 0 {
                *budget -= len;
                seq.planned = Some(Work::Prefill { len });
                extends.push(ExtendSpec {
                    seq_id: seq.seq_id,
                    new_tokens: Vec::new(),
                    written_tokens: ahead.kv_len + len,
                    // a progress report grows nothing: not checked
                    from_length: 0,
                });
            }
        }
        extends
    }

    /// The extends a settle sends (at [`Core::settle_step`]): `planned`
    /// (what `Call::Plan` kept) and, in the pipelined order, every decoding
    /// sequence's report of the tokens the collected pass told, which grows
    /// its lease [`super::Order::lookahead`] slots past them. A report names only
    /// tokens whose KV a pass launched has written or writes (the cache
    /// publishes the blocks they fill once that step completes): with a pass
    /// in flight, through the token it feeds; with none, through the last
    /// position written.
    pub fn settle_extends(&mut self, planned: Vec<ExtendSpec>) -> Vec<ExtendSpec> {
        // steps that only added a pass planned chunks of one prompt each:
        // one report per sequence (the cache refuses a batch naming one
        // twice), the furthest, which the settle's step covers
        let mut planned = furthest_progress(planned);
        if !self.config.order.is_pipelined() {
            return planned;
        }
        for seq in self.running.values_mut() {
            if !seq.decoding() {
                continue;
            }
            let written = seq.kv_len + u32::from(!seq.in_flight.is_empty());
            let (from, to) = (seq.cache_len as usize, written as usize);
            if from < to && to <= seq.context.len() {
                planned.push(ExtendSpec {
                    seq_id: seq.seq_id,
                    new_tokens: seq.context[from..to].to_vec(),
                    written_tokens: 0,
                    from_length: seq.cache_len,
                });
                seq.reporting = written;
            }
        }
        planned
    }

    /// Whether `seq_id`'s work is in a forward pass in flight.
    pub fn in_flight(&self, seq_id: SeqId) -> bool {
        self.running
            .get(&seq_id)
            .is_some_and(|s| !s.in_flight.is_empty())
    }

    /// An Extend call failed: the decode sequences it was to grow sit this
    /// step out and try again next step. The loop splits a step's extends
    /// into calls of at most the cache's batch limit and stops at the first
    /// that fails; it applies the outcomes of those answered before
    /// (`apply_extends`) and then calls this: a sequence the cache already
    /// grew keeps its decode (planning it again would grow it twice).
    pub fn extends_failed(&mut self) {
        self.tier_call_failed();
        for seq in self.running.values_mut() {
            if matches!(seq.planned, Some(Work::Decode { .. })) && seq.cache_len < seq.kv_len + 1 {
                seq.planned = None;
            }
        }
    }

    /// Applies the outcomes of Extend calls that named `step` (this step's,
    /// or in the overlap orders the last one's, when a settle's answer is
    /// applied after the next step began): grants update tables; a refused
    /// sequence is dropped from the step and preempted or finished
    /// `REJECTED`.
    pub fn apply_extends(&mut self, step: Step, outcomes: Vec<Outcome>) {
        self.collect_tier_copies(step, &outcomes);
        for outcome in outcomes {
            match outcome {
                Outcome::Grant(grant) => {
                    if let Some(seq) = self.running.get_mut(&grant.seq_id) {
                        // a prefill chunk's progress report grows nothing
                        // (its chunk planned, or launched when the extends
                        // follow the launch: a sequence reports progress
                        // only while its prompt is not all in its KV)
                        if !seq.decoding() {
                            continue;
                        }
                        crate::domain::apply_extend(&mut seq.tables, &grant.tables);
                        seq.cache_len = seq.reporting;
                        if grant.capacity_tokens > 0 {
                            seq.capacity = grant.capacity_tokens;
                        }
                    }
                }
                Outcome::Reject(reject) => self.extend_refused(reject),
            }
        }
        // a planned decode that got no outcome at all must not run
        for seq in self.running.values_mut() {
            if matches!(seq.planned, Some(Work::Decode { .. })) && seq.cache_len < seq.kv_len + 1 {
                seq.planned = None;
            }
        }
        self.advance_beams();
    }

    fn extend_refused(&mut self, reject: Reject) {
        let seq_id = reject.seq_id;
        let Some(seq) = self.running.get(&seq_id) else {
            return;
        };
        if reject.reason == RejectReason::LengthMismatch {
            // The cache applied an earlier growth whose answer was lost (a
            // failed call it had taken): the core knows neither the blocks
            // nor the copies it granted, so the sequence is recomputed. At
            // rest, the tokens that growth recorded may be past what any
            // pass wrote (a decode that sat its step out): its blocks go
            // back without publishing them. With passes in flight, those
            // wrote what it reported, and it is released once they return
            // (discarding if one fails).
            let at_rest = seq.in_flight.is_empty();
            self.preempt(
                seq_id,
                PreemptCause::LengthMismatch,
                Finish::Rejected(reject),
            );
            if at_rest {
                self.release_discarding(vec![seq_id]);
            }
            return;
        }
        let transient = matches!(
            reject.reason,
            RejectReason::PoolExhausted | RejectReason::QuotaExceeded
        );
        self.exhausted_this_step |= transient;
        if seq.request.is_started_beam() && seq.in_flight.is_empty() {
            // a beam that cannot grow is dropped; the search goes on
            self.drop_beam(seq_id, Finish::Rejected(reject));
            return;
        }
        if !seq.in_flight.is_empty() {
            // An extend sent after its decode launched, growing the lease a
            // step ahead: the pass in flight had room and runs to its end.
            // The cache added nothing; the sequence sits the next step out
            // when it has no room and its extend is asked again, from a
            // sequence at rest, where a refusal counts as below.
            return;
        }
        let preempt = transient
            && self.config.policy == Policy::MaxUtilization
            && self.config.on_exhausted == OnExhausted::Preempt;
        if preempt {
            let cause = match reject.reason {
                RejectReason::QuotaExceeded => PreemptCause::QuotaExceeded,
                _ => PreemptCause::PoolExhausted,
            };
            self.preempt(seq_id, cause, Finish::Rejected(reject));
        } else {
            if self.config.policy != Policy::MaxUtilization {
                tracing::error!(seq_id = seq_id.get(), reason = %reject.reason, "extend refused under a reserving policy");
            }
            self.end_sequence(seq_id, Finish::Rejected(reject));
        }
    }

    /// The forward batches of this step, per group index. Planned sequences
    /// become in flight, and so does the step's forward pass: until every
    /// group's results are applied (or failed), releases are fenced at this
    /// step and it cannot be reported complete.
    pub fn plan_forward(&mut self) -> Vec<(usize, Vec<ForwardItem>)> {
        let step = self.step();
        let mut batches: Vec<Vec<ForwardItem>> = vec![Vec::new(); self.groups.len()];
        for seq in self.running.values_mut() {
            let Some(work) = seq.planned.take() else {
                continue;
            };
            // after what its passes in flight write (the pipelined order)
            let start = seq.ahead().kv_len;
            let at = start as usize;
            // a decode behind a pass in flight feeds the token that pass
            // samples: the worker fills it in
            let feed_previous = matches!(work, Work::Decode { .. }) && !seq.in_flight.is_empty();
            let (tokens, all_argmax) = match &work {
                Work::Prefill { len } => (seq.context[at..at + *len as usize].to_vec(), false),
                Work::Decode { .. } if feed_previous => (Vec::new(), false),
                Work::Decode { drafts } => {
                    let mut t = Vec::with_capacity(1 + drafts.len());
                    t.push(seq.context[at]);
                    t.extend_from_slice(drafts);
                    (t, !drafts.is_empty())
                }
            };
            // a penalised or constrained sequence's first pass tells the
            // worker what it holds (with the grammar); the worker counts
            // every later token itself
            let sampling = &seq.request.sampling;
            let history =
                (sampling.needs_history() && !seq.history_sent).then(|| seq.context[..at].to_vec());
            seq.history_sent |= history.is_some();
            let logprobs = if seq.request.beam_width > 1 {
                let end = match &work {
                    Work::Prefill { len } => at + *len as usize,
                    Work::Decode { .. } => seq.context.len(),
                };
                Self::beam_item_logprobs(&seq.request, end, seq.context.len())
            } else {
                item_logprobs(&seq.request, &work, &seq.context, at)
            };
            // until min_tokens outputs are known (later ones are past it)
            let stop_ids = if seq.request.generated.len() < sampling.min_tokens as usize {
                seq.request.stop_tokens.clone()
            } else {
                Vec::new()
            };
            batches[seq.group].push(ForwardItem {
                seq_id: seq.seq_id,
                tokens,
                feed_previous,
                start_pos: start,
                tables: seq.tables.clone(),
                return_all_argmax: all_argmax,
                sampling: sampling.clone(),
                prompt_len: seq.request.prompt.len() as u32,
                stop_ids,
                history,
                copies: std::mem::take(&mut seq.copies),
                logprobs,
                peer_pull: seq.peer.take(),
            });
            seq.in_flight.push_back((step, work));
        }
        // A group whose grants named host-tier copies runs them even with
        // no sequence this step (see `tiers`).
        let with_copies = self.groups_with_tier_copies();
        let batches: Vec<(usize, Vec<ForwardItem>)> = batches
            .into_iter()
            .enumerate()
            .filter(|(g, b)| !b.is_empty() || with_copies.contains(g))
            .collect();
        self.forward_launched(batches.iter().map(|(g, _)| *g).collect());
        batches
    }

    /// Applies one group's forward answer (its results, or a
    /// [`ForwardAnswer`] with the pass's timing): prefill progress, new
    /// tokens, finished requests, and the peer-pull rates it measures. An
    /// in-flight sequence without a result fails.
    pub fn apply_forward(&mut self, group: usize, answer: impl Into<ForwardAnswer>) {
        let ForwardAnswer {
            results,
            compute_us,
            pulls,
        } = answer.into();
        // the oldest pass the group owes: its worker runs passes in order
        let Some(step) = self.steps.owed_by(group) else {
            return;
        };
        for &(bytes, micros) in &pulls {
            self.measured.pulled(bytes, micros);
        }
        let (mut tokens, mut prefill) = (0u64, 0u64);
        let mut pulls_failed = Vec::new();
        // the sequences this pass ran, when an ended one waits for it (one
        // it did not run wrote nothing); none in steady decode
        let waiting = self.draining_in(group);
        let mut ran = std::collections::HashSet::new();
        for result in results {
            if waiting && result.error.is_none() {
                ran.insert(result.seq_id);
            }
            let Some(seq) = self.running.get_mut(&result.seq_id) else {
                continue;
            };
            if seq.in_flight.front().is_none_or(|(s, _)| *s != step) {
                continue;
            }
            seq.pulling = false;
            if let Some(error) = result.error {
                // its pass returned (without it): it owes nothing more
                seq.in_flight.pop_front();
                pulls_failed.push((result.seq_id, error));
                continue;
            }
            let Some((_, work)) = seq.in_flight.pop_front() else {
                continue;
            };
            let mut logprobs = result.logprobs;
            match &work {
                Work::Prefill { len } => {
                    tokens += u64::from(*len);
                    prefill += u64::from(*len);
                }
                Work::Decode { drafts } => tokens += 1 + drafts.len() as u64,
            }
            let emit = match work {
                Work::Prefill { len } => {
                    let at = seq.kv_len as usize;
                    seq.kv_len += len;
                    if seq.request.needs_prompt_logprobs() {
                        // row i chose the token at `at + i + 1`: the prompt's
                        // up to its last row, which chose the first output
                        let last = (seq.kv_len >= seq.lease_len)
                            .then(|| logprobs.pop())
                            .flatten();
                        seq.request.prompt_logprobs.truncate(at);
                        seq.request.prompt_logprobs.append(&mut logprobs);
                        logprobs.extend(last);
                    }
                    if seq.kv_len < seq.lease_len {
                        continue;
                    }
                    vec![result.next_token]
                }
                Work::Decode { drafts } => {
                    if drafts.is_empty() {
                        seq.kv_len += 1;
                        vec![result.next_token]
                    } else {
                        match spec::verify(&drafts, &result.argmax) {
                            Some((accepted, emit)) => {
                                seq.kv_len += 1 + accepted as u32;
                                emit
                            }
                            None => {
                                let id = seq.seq_id;
                                self.end_sequence(
                                    id,
                                    Finish::Error("worker returned too few argmax tokens".into()),
                                );
                                continue;
                            }
                        }
                    }
                }
            };
            if seq.request.beam_width > 1 {
                self.beam_row(result.seq_id, logprobs);
            } else {
                self.emit(result.seq_id, emit, logprobs);
            }
        }
        self.measured
            .computed(tokens, prefill, compute_us, !pulls.is_empty());
        self.tier_forward_returned(group, step, false);
        let missing: Vec<SeqId> = self
            .running
            .values()
            .filter(|s| s.group == group && s.in_flight.front().is_some_and(|(s, _)| *s == step))
            .map(|s| s.seq_id)
            .collect();
        for &seq_id in &missing {
            self.end_sequence(
                seq_id,
                Finish::Error("worker returned no result for the sequence".into()),
            );
        }
        // the pass may not have written what their extends reported
        self.release_discarding(missing);
        self.pulls_failed(pulls_failed);
        // last, once everything this answer ended waits here
        self.drain_answered(group, step, &ran);
        self.forward_returned(group);
        self.advance_beams();
    }

    /// Sequences whose peer pull failed (the worker ran the rest of the
    /// pass without them): each is released with its unwritten blocks
    /// discarded and requeued to be recomputed, never pulled again (or
    /// ends `ERROR` past its preemptions), as after a failed pass.
    fn pulls_failed(&mut self, failed: Vec<(SeqId, String)>) {
        for (seq_id, error) in failed {
            let Some(seq) = self.running.get_mut(&seq_id) else {
                continue;
            };
            tracing::warn!(seq_id = seq_id.get(), %error, "peer pull failed: recomputing the sequence");
            seq.request.peer_pull_failed = true;
            self.preempt(
                seq_id,
                PreemptCause::WorkerFailed,
                Finish::Error(format!("peer pull failed: {error}")),
            );
            self.release_discarding(vec![seq_id]);
        }
    }

    /// One group's forward pass failed: the group takes no new requests for
    /// [`WORKER_RETRY_AFTER`], and its in-flight requests are requeued for
    /// recompute on whichever replica admits them next (their tokens so far
    /// kept, their blocks released), like a preemption; a request already
    /// requeued `max_preemptions` times ends `ERROR`, naming the group.
    pub fn forward_failed(&mut self, group: usize, message: &str) {
        if let Some(slot) = self.down_until.get_mut(group) {
            *slot = Some(Instant::now() + WORKER_RETRY_AFTER);
        }
        let message = match self.groups.get(group) {
            Some(g) => format!("worker of group {} failed: {message}", g.name),
            None => message.to_owned(),
        };
        let message = message.as_str();
        // the sequences of the failed pass (the oldest the group owes); a
        // later pass in flight that feeds on it fails at the worker too
        let step = self.steps.owed_by(group);
        let failed: Vec<SeqId> = self
            .running
            .values()
            .filter(|s| {
                s.group == group && s.in_flight.front().is_some_and(|(s, _)| Some(*s) == step)
            })
            .map(|s| s.seq_id)
            .collect();
        if !failed.is_empty() {
            tracing::warn!(sequences = failed.len(), %message, "forward failed: requeuing its sequences for recompute");
        }
        for &seq_id in &failed {
            self.preempt(
                seq_id,
                PreemptCause::WorkerFailed,
                Finish::Error(format!("forward failed: {message}")),
            );
        }
        // The pass may not have written what their blocks' pending hashes
        // promise: they are released apart, so the cache never publishes it.
        self.release_discarding(failed);
        if let Some(step) = step {
            self.tier_forward_returned(group, step, true);
            self.drain_failed(group, step);
        }
        self.forward_returned(group);
        self.advance_beams();
    }

    /// Streams `tokens` (with their `logprobs`, when asked: one per token)
    /// and ends the request at a stop token or its length.
    fn emit(&mut self, seq_id: SeqId, tokens: Vec<u32>, mut logprobs: Vec<TokenLogprob>) {
        let Some(seq) = self.running.get_mut(&seq_id) else {
            return;
        };
        // The prompt is prefilled: the other samples fork from it now (its
        // KV before the last prompt token shared, each branch computing
        // that token and sampling its own first one).
        if seq.request.n > 1 && seq.request.generated.is_empty() {
            let n = std::mem::replace(&mut seq.request.n, 1);
            for index in 1..n {
                self.forks.push(super::Fork {
                    parent: seq_id,
                    group: seq.group,
                    request: seq.request.branch(index),
                });
            }
        }
        let mut out = Vec::with_capacity(tokens.len());
        let mut finish = None;
        for t in tokens {
            out.push(t);
            seq.context.push(t);
            seq.request.generated.push(t);
            // the worker holds stop tokens back until min_tokens
            let held = seq.request.generated.len() <= seq.request.sampling.min_tokens as usize;
            if !held && seq.request.stop_tokens.contains(&t) {
                finish = Some(Finish::Stop);
                break;
            }
            if seq.request.remaining() == 0 {
                finish = Some(Finish::Length);
                break;
            }
        }
        let reused_tokens = if seq.request.reported_reuse {
            None
        } else {
            seq.request.reported_reuse = true;
            Some((seq.reused_tokens, seq.request.retained_tokens))
        };
        logprobs.truncate(out.len());
        let prompt_logprobs = seq.request.owes_prompt_logprobs().then(|| {
            seq.request.reported_prompt_logprobs = true;
            std::mem::take(&mut seq.request.prompt_logprobs)
        });
        self.outputs.push(Output::Tokens {
            request: seq.request.id,
            index: seq.request.index,
            tokens: out,
            reused_tokens,
            logprobs,
            prompt_logprobs,
        });
        if let Some(finish) = finish {
            self.end_sequence(seq_id, finish);
        }
    }
}

/// `extends` with one prefill progress report per sequence (no tokens,
/// `written_tokens` absolute): the furthest, where the first one was.
fn furthest_progress(mut extends: Vec<ExtendSpec>) -> Vec<ExtendSpec> {
    let mut first: HashMap<SeqId, usize> = HashMap::new();
    let mut keep = vec![true; extends.len()];
    for i in 0..extends.len() {
        let e = &extends[i];
        if !e.new_tokens.is_empty() {
            continue;
        }
        match first.get(&e.seq_id) {
            Some(&at) => {
                extends[at].written_tokens = extends[at].written_tokens.max(e.written_tokens);
                keep[i] = false;
            }
            None => {
                first.insert(e.seq_id, i);
            }
        }
    }
    let mut k = keep.into_iter();
    extends.retain(|_| k.next().unwrap_or(true));
    extends
}

/// What a forward item of `request` asks the worker's logprobs for: a
/// prompt chunk of a request that wants the prompt's logprobs reports every
/// position (the next chunk's first token chosen at its last row); the
/// last prefill chunk and every decode report the next token's; other
/// chunks nothing.
fn item_logprobs(
    request: &Request,
    work: &Work,
    context: &[u32],
    at: usize,
) -> Option<ItemLogprobs> {
    let asked = request.logprobs?;
    let end = match work {
        Work::Prefill { len } => at + *len as usize,
        Work::Decode { .. } => context.len(),
    };
    let prompt = matches!(work, Work::Prefill { .. }) && request.needs_prompt_logprobs();
    let next_prompt_token = context.get(end).copied().filter(|_| prompt);
    if !prompt && end < context.len() {
        // a chunk that is not the prompt's last: its pick is thrown away
        return None;
    }
    Some(ItemLogprobs {
        top: asked.top,
        prompt,
        next_prompt_token,
    })
}
