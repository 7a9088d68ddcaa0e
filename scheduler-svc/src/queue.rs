//! Waiting requests, first come first served.
//!
//! The queue is kept in arrival order: new requests go to the back and a
//! preempted request goes back to where its arrival puts it (ahead of every
//! later arrival), so recompute never starves behind newcomers. Admission is
//! head-of-line: it stops at the first request that does not fit now, and
//! never skips it for a smaller one behind it.

use std::collections::VecDeque;

use std::time::Instant;

use crate::domain::{Extra, Logprobs, Reject, RequestId, Retain, Sampling, TokenLogprob};

/// A client request and what it has produced so far.
#[derive(Debug, Clone)]
pub struct Request {
    /// Stable id (also the arrival order).
    pub id: RequestId,
    /// Prompt token ids (never empty).
    pub prompt: Vec<u32>,
    /// Tokens generated so far (kept across preemptions).
    pub generated: Vec<u32>,
    /// Output tokens to generate at most.
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop_tokens: Vec<u32>,
    pub priority: u32,
    pub cache_salt: String,
    /// Its retention hint, with the tenant whose quota it counts against.
    pub retain: Option<Retain>,
    /// Prompt tokens the cache keeps under `retain` (its last grant).
    pub retained_tokens: u32,
    /// Times the request was preempted and requeued for recompute.
    pub preemptions: u32,
    /// Whether `reused_tokens` was already reported on the stream.
    pub reported_reuse: bool,
    /// Since when it waits in the queue (stamped by [`crate::step::Core::expire_queue`]);
    /// kept across refused leases, cleared when it is preempted after running.
    pub queued_at: Option<Instant>,
    /// The cache's last refusal that sent it back to wait, for the figures
    /// of a `QUEUE_TIMEOUT`.
    pub last_refusal: Option<Reject>,
    /// Branches (parallel samples) still to fork from this one once its
    /// prompt is prefilled, itself included: 1 once forked, or for a
    /// request of one sample.
    pub n: u32,
    /// Which branch this is (0 to the request's `n - 1`).
    pub index: u32,
    /// Log-probabilities asked for; `None`: none.
    pub logprobs: Option<Logprobs>,
    /// The prompt's logprobs computed so far (entry `i`: prompt token
    /// `i + 1`), until they are reported with the first output.
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Whether the prompt's logprobs were reported.
    pub reported_prompt_logprobs: bool,
    /// Beam search width (`GenerateRequest.beam_width`); 1: off. Every
    /// beam of a search carries it (see `step::beams`).
    pub beam_width: u32,
    /// A beam's cumulative logprob of its generated tokens.
    pub beam_logprob: f64,
    /// A peer pull of its prefix failed: it is recomputed, never pulled
    /// again.
    pub peer_pull_failed: bool,
}

impl Request {
    /// A new request with nothing generated yet.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_tokens: u32) -> Self {
        Self {
            id,
            prompt,
            generated: Vec::new(),
            max_tokens,
            sampling: Sampling::default(),
            stop_tokens: Vec::new(),
            priority: 0,
            cache_salt: String::new(),
            retain: None,
            retained_tokens: 0,
            preemptions: 0,
            reported_reuse: false,
            queued_at: None,
            last_refusal: None,
            n: 1,
            index: 0,
            logprobs: None,
            prompt_logprobs: Vec::new(),
            reported_prompt_logprobs: false,
            beam_width: 1,
            beam_logprob: 0.0,
            peer_pull_failed: false,
        }
    }

    /// Whether it is a beam of a search that has started (it generated a
    /// token the search chose): it is never requeued, a beam ends instead.
    pub fn is_started_beam(&self) -> bool {
        self.beam_width > 1 && !self.generated.is_empty()
    }

    /// Branch `index` of a request of several samples, forked from this
    /// one (branch 0) before anything was generated: the same prompt and
    /// limits, its own seed (see [`branch_seed`]), no retention hint (the
    /// parent's holds the prompt).
    pub fn branch(&self, index: u32) -> Self {
        let mut b = Self::new(self.id, self.prompt.clone(), self.max_tokens);
        b.sampling = self.sampling.clone();
        b.sampling.seed = branch_seed(self.sampling.seed, index);
        b.stop_tokens = self.stop_tokens.clone();
        b.priority = self.priority;
        b.cache_salt = self.cache_salt.clone();
        b.index = index;
        // every sample reports its own tokens' logprobs; the prompt's go
        // with sample 0
        b.logprobs = self.logprobs.map(|l| Logprobs { prompt: false, ..l });
        // the request reports its prompt's reuse once, with sample 0
        b.reported_reuse = true;
        b
    }

    /// Whether the prompt's logprobs are asked and not reported yet (they
    /// go with the first output).
    pub fn owes_prompt_logprobs(&self) -> bool {
        self.logprobs.is_some_and(|l| l.prompt) && !self.reported_prompt_logprobs
    }

    /// Whether its next lease must compute every prompt position: the
    /// prompt's logprobs are asked and not known yet.
    pub fn needs_prompt_logprobs(&self) -> bool {
        self.owes_prompt_logprobs() && self.generated.is_empty()
    }

    /// The tokens a lease must cover now: the prompt plus anything generated
    /// before a preemption (recomputed).
    pub fn context(&self) -> Vec<u32> {
        let mut all = Vec::with_capacity(self.prompt.len() + self.generated.len());
        all.extend_from_slice(&self.prompt);
        all.extend_from_slice(&self.generated);
        all
    }

    /// Length of [`Self::context`].
    pub fn context_len(&self) -> usize {
        self.prompt.len() + self.generated.len()
    }

    /// Tokens still to generate.
    pub fn remaining(&self) -> u32 {
        self.max_tokens
            .saturating_sub(u32::try_from(self.generated.len()).unwrap_or(u32::MAX))
    }

    /// Token slots over the request's whole life: prompt, every generated
    /// token but the last (whose KV is never written) and the extra slots.
    pub fn full_life_tokens(&self, extra: Extra) -> u32 {
        let prompt = u32::try_from(self.prompt.len()).unwrap_or(u32::MAX);
        prompt
            .saturating_add(self.max_tokens.saturating_sub(1))
            .saturating_add(extra.total())
    }

    /// What admitting it asks of the pools: its next lease and whole life,
    /// and while its samples (or beams) are not forked, their shared prompt
    /// blocks once and the rest per sample (per beam: at worst every beam
    /// holds its own copy of everything past the prompt's full blocks).
    pub fn demand(&self, extra: Extra) -> crate::policy::Demand {
        let mut d =
            crate::policy::Demand::new(self.lease_tokens(extra), self.full_life_tokens(extra));
        let branches = if self.beam_width > 1 && self.generated.is_empty() {
            self.beam_width
        } else {
            self.n
        };
        if branches > 1 {
            d.branches = branches;
            d.shared_tokens = u32::try_from(self.prompt.len() - 1).unwrap_or(u32::MAX);
        }
        d
    }

    /// Token slots the next lease takes: the context plus the extra slots.
    pub fn lease_tokens(&self, extra: Extra) -> u32 {
        let context = u32::try_from(self.prompt.len() + self.generated.len()).unwrap_or(u32::MAX);
        context.saturating_add(extra.total())
    }
}

/// The seed of branch `index` of a request seeded `seed`: branch 0 keeps
/// it (one sample is what it was), the others get seeds apart from it and
/// from each other (splitmix64 of the pair), so n samples with a seed are
/// n different, reproducible completions.
pub fn branch_seed(seed: u64, index: u32) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ u64::from(index).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Waiting requests in arrival order.
#[derive(Debug, Default)]
pub struct Queue {
    items: VecDeque<Request>,
}

impl Queue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a new request at the back. Ids are expected to grow; an older id
    /// is placed by arrival like a requeued one.
    pub fn push(&mut self, request: Request) {
        match self.items.back() {
            Some(last) if last.id > request.id => self.requeue(request),
            _ => self.items.push_back(request),
        }
    }

    /// Puts a preempted request back at its arrival position.
    pub fn requeue(&mut self, request: Request) {
        let at = self.items.partition_point(|r| r.id < request.id);
        self.items.insert(at, request);
    }

    /// The head of the queue.
    pub fn front(&self) -> Option<&Request> {
        self.items.front()
    }

    /// Removes and returns the requests `expired` picks, with their
    /// (0-based) queue positions.
    pub fn take_expired(
        &mut self,
        mut expired: impl FnMut(&mut Request) -> bool,
    ) -> Vec<(usize, Request)> {
        let mut kept = VecDeque::with_capacity(self.items.len());
        let mut gone = Vec::new();
        for (at, mut r) in std::mem::take(&mut self.items).into_iter().enumerate() {
            if expired(&mut r) {
                gone.push((at, r));
            } else {
                kept.push_back(r);
            }
        }
        self.items = kept;
        gone
    }

    /// Removes and returns the head of the queue.
    pub fn pop(&mut self) -> Option<Request> {
        self.items.pop_front()
    }

    /// Removes a request by id (cancellation).
    pub fn remove(&mut self, id: RequestId) -> Option<Request> {
        let at = self.items.iter().position(|r| r.id == id)?;
        self.items.remove(at)
    }

    /// Removes branch `index` of request `id`, if it waits here.
    pub fn remove_branch(&mut self, id: RequestId, index: u32) -> Option<Request> {
        let at = self
            .items
            .iter()
            .position(|r| r.id == id && r.index == index)?;
        self.items.remove(at)
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Waiting requests that were preempted at least once.
    pub fn preempted(&self) -> usize {
        self.items.iter().filter(|r| r.preemptions > 0).count()
    }

    /// The first `n` requests, in queue order.
    pub fn head(&self, n: usize) -> impl Iterator<Item = &Request> + '_ {
        self.items.iter().take(n)
    }

    /// Ids in queue order.
    pub fn ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.items.iter().map(|r| r.id)
    }

    /// Removes every request (shutdown).
    pub fn drain(&mut self) -> impl Iterator<Item = Request> + '_ {
        self.items.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requeued_request_goes_ahead_of_later_arrivals() {
        let mut q = Queue::new();
        for id in [2, 3, 5] {
            q.push(Request::new(RequestId(id), vec![1], 1));
        }
        q.requeue(Request::new(RequestId(1), vec![1], 1));
        q.requeue(Request::new(RequestId(4), vec![1], 1));
        assert_eq!(
            q.ids().map(RequestId::get).collect::<Vec<_>>(),
            vec![1, 2, 3, 4, 5]
        );
        assert_eq!(q.remove(RequestId(3)).map(|r| r.id.get()), Some(3));
        assert_eq!(q.pop().map(|r| r.id.get()), Some(1));
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn life_and_lease_tokens_count_extra_slots() {
        let mut r = Request::new(RequestId(1), vec![7; 10], 5);
        let extra = Extra {
            draft: 3,
            ..Extra::default()
        };
        assert_eq!(r.full_life_tokens(extra), 10 + 4 + 3);
        r.generated = vec![1, 2];
        assert_eq!(r.lease_tokens(extra), 12 + 3);
        assert_eq!(r.remaining(), 3);
        // recompute does not change the whole-life need
        assert_eq!(r.full_life_tokens(extra), 17);
    }
}
