//! The call order of one step, once: which calls the loop makes and in what
//! order, with overlap on or off. The async loop (`step_loop/`) and the
//! model-checked test driver (`step/tests/model.rs`) both execute a
//! [`StepPlan`] call by call, so the order the model check proves safe is
//! the order the loop runs.
//!
//! ```text
//! overlap, a pass in flight:  flush releases, admit, collect, plan, launch,
//!                             settle+extend
//! overlap, nothing in flight: flush releases, admit, extend, launch
//! pipelined, depth in flight: flush releases, admit, collect (the oldest),
//!                             plan, launch, settle+extend
//! pipelined, fewer in flight: flush releases, admit, plan, launch; if it
//!                             launched nothing: collect, settle+extend
//! pipelined, none in flight:  as overlap
//! plain:                      flush releases, extend, admit, launch, then
//!                             (if it launched) collect, settle
//! ```
//!
//! Pipelined keeps passes queued at the worker while one runs (`depth` in
//! flight in all, two by default): pass N+1 is sent before pass N's answer
//! is back, its decode items feeding the token pass N samples
//! (`ForwardItem::feed_previous`, the worker fills it in), so the device
//! goes from one pass to the next without waiting for the answer's round
//! trip and the scheduler's work between passes. A third pass in flight
//! gives that turnaround a whole pass more to hide in, for one more pass of
//! a finished sequence's work thrown away (and one more lookahead slot per
//! lease).
//!
//! With a pass in flight, overlap takes the cache off the token's critical
//! path: the collected pass's successor launches at once, on slots its
//! lease already covers (each lease keeps lookahead slots past its length),
//! and the step's extends (the fed tokens, growth a step ahead, prefill
//! progress) ride the `Step` call that settles the collected pass while the
//! new one runs. A decode without room sits the step out (`plan_extends`).
//!
//! A step that neither launched nor collected a forward pass ends with a
//! retry of `CompleteStep` (one the cache did not acknowledge earlier).
//! Outside a step (before re-opening a lost session, at shutdown), the pass
//! in flight is finished with [`StepPlan::finish_in_flight`]: collect, settle.

use std::collections::VecDeque;

/// Whether a step's calls overlap the previous step's forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Every call of a step runs before its forward pass, which is awaited
    /// within the step.
    Plain,
    /// Step N+1's releases and leases run while forward N is in flight; the
    /// pass is collected in the next step, step N+1's pass launched at once
    /// and its extends sent while it runs.
    Overlap,
    /// Overlap with `depth` (2 or more) passes in flight: with `depth` 2,
    /// step N+2's pass is launched right after pass N is collected, while
    /// N+1 runs, its decodes fed by the worker from N+1's samples. Needs no
    /// drafts (a draft needs the token it follows).
    Pipelined { depth: u32 },
}

/// The pipeline depth by default: two passes in flight.
pub const DEFAULT_PIPELINE_DEPTH: u32 = 2;

/// The deepest pipeline: the worker remembers its last few passes
/// (`worker-svc/src/pipeline.rs`), and each pass deeper costs every lease
/// a lookahead slot and every finished sequence a pass thrown away.
pub const MAX_PIPELINE_DEPTH: u32 = 4;

impl Order {
    /// The order for the loop's `overlap` setting: pipelined `depth` deep
    /// (1: overlap), unless speculation (`draft_k` > 0) needs each token
    /// back before the next pass is planned. `depth` is clamped to
    /// 1..=[`MAX_PIPELINE_DEPTH`] (the configuration refuses others).
    pub fn from_overlap(overlap: bool, draft_k: u32, depth: u32) -> Self {
        match (overlap, draft_k, depth.min(MAX_PIPELINE_DEPTH)) {
            (false, _, _) => Self::Plain,
            (true, 0, depth @ 2..) => Self::Pipelined { depth },
            (true, _, _) => Self::Overlap,
        }
    }

    /// The pipelined order of the default depth.
    pub const fn pipelined() -> Self {
        Self::Pipelined {
            depth: DEFAULT_PIPELINE_DEPTH,
        }
    }

    /// Whether passes are sent behind passes in flight.
    pub fn is_pipelined(self) -> bool {
        matches!(self, Self::Pipelined { .. })
    }

    /// Forward passes a sequence may have in flight at once (a pipeline
    /// is at least two deep, however it was built).
    pub fn depth(self) -> usize {
        match self {
            Self::Plain | Self::Overlap => 1,
            Self::Pipelined { depth } => depth.max(2) as usize,
        }
    }

    /// Token slots a lease keeps past the sequence's length so that its
    /// decodes launch on slots already granted: one per pass that may run
    /// before the extend reporting its token is answered (a pipelined
    /// decode launches `depth - 1` passes past the last settled one).
    pub fn lookahead(self) -> u32 {
        match self {
            Self::Plain => 0,
            Self::Overlap => 1,
            Self::Pipelined { depth } => depth.max(2),
        }
    }
}

/// One call of a step, as the loop makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// Send every release the core hands out (`take_releases` ->
    /// `Release` -> `releases_sent`), in batches of the cache's limit.
    FlushReleases,
    /// Lease the step's admissions (`plan_admission` -> `Lease` ->
    /// `apply_leases`).
    Admit,
    /// Extend the running sequences (`plan_extends` -> `Extend` ->
    /// `apply_extends`).
    Extend,
    /// Plan the running sequences' work with room in their leases
    /// (`plan_extends(true)`), keeping its extends for the `Settle` after
    /// the launch.
    Plan,
    /// Plan the forward batches and launch them (`plan_forward` ->
    /// `Forward`); the loop reports whether anything launched with
    /// [`StepPlan::launched`].
    Launch,
    /// Wait for the forward pass in flight and apply its results
    /// (`apply_forward`, per group).
    Collect,
    /// After a collected pass: its releases (fenced at its step), the
    /// completion the core allows and, with `extend`, this step's extends
    /// (those `Plan` kept, else planned now), in one `Step` call the cache
    /// applies in that order.
    Settle { extend: bool },
    /// Retry a `CompleteStep` the cache did not acknowledge.
    RetryComplete,
}

/// An overlapped step with a pass to collect: lease, collect the pass,
/// plan and launch the next, settle the collected one with the step's
/// extends.
const COLLECTING: [Call; 6] = [
    Call::FlushReleases,
    Call::Admit,
    Call::Collect,
    Call::Plan,
    Call::Launch,
    Call::Settle { extend: true },
];

/// The calls of one step, handed out one at a time.
#[derive(Debug, Clone)]
pub struct StepPlan {
    order: Order,
    /// Passes in flight at the step's start.
    in_flight: usize,
    calls: VecDeque<Call>,
    /// `Launch` was handed out and its answer not reported yet.
    launching: bool,
    /// A forward pass was launched or collected in this step.
    progressed: bool,
}

impl StepPlan {
    /// The plan of a step in `order`; `in_flight`: forward passes of
    /// earlier steps still running (none with plain, at most one with
    /// overlap, `depth` with pipelined).
    pub fn new(order: Order, in_flight: usize) -> Self {
        use Call::*;
        let calls: &[Call] = match (order, in_flight) {
            // a plain step awaits its own pass: none is in flight at its start
            (Order::Plain, _) => &[FlushReleases, Extend, Admit, Launch],
            (_, 0) => &[FlushReleases, Admit, Extend, Launch],
            // another pass goes in at once; nothing launched, the oldest in
            // flight is collected (`launched`)
            (Order::Pipelined { .. }, n) if n < order.depth() => {
                &[FlushReleases, Admit, Plan, Launch]
            }
            (Order::Overlap | Order::Pipelined { .. }, _) => &COLLECTING,
        };
        Self {
            order,
            in_flight,
            calls: calls.iter().copied().collect(),
            launching: false,
            progressed: false,
        }
    }

    /// The calls that finish the forward pass in flight outside a step:
    /// collect it, then settle it (its releases and completion, no extends).
    pub fn finish_in_flight() -> Self {
        Self {
            order: Order::Plain,
            in_flight: 1,
            calls: VecDeque::from([Call::Collect, Call::Settle { extend: false }]),
            launching: false,
            progressed: false,
        }
    }

    /// The next call to make, or `None` once the step is done. After
    /// [`Call::Launch`], report its answer with [`StepPlan::launched`]
    /// before asking again.
    pub fn next_call(&mut self) -> Option<Call> {
        debug_assert!(!self.launching, "Launch's answer was not reported");
        let call = self.calls.pop_front()?;
        match call {
            Call::Collect => self.progressed = true,
            Call::Launch => self.launching = true,
            _ => {}
        }
        Some(call)
    }

    /// Whether the `Launch` just handed out started a forward pass.
    pub fn launched(&mut self, launched: bool) {
        debug_assert!(self.launching, "launched() without a Launch");
        self.launching = false;
        if launched {
            self.progressed = true;
            if self.order == Order::Plain {
                self.calls.push_back(Call::Collect);
                self.calls.push_back(Call::Settle { extend: false });
            }
        } else if self.order.is_pipelined()
            && self.in_flight > 0
            && self.in_flight < self.order.depth()
        {
            // passes in flight and no more added: collect the oldest, so
            // the step progresses (and its extends are sent)
            self.progressed = true;
            self.calls.push_back(Call::Collect);
            self.calls.push_back(Call::Settle { extend: true });
        }
        if !self.progressed {
            self.calls.push_back(Call::RetryComplete);
        }
    }

    /// Whether a `Launch` is still to come in this step (the overlap orders
    /// after a `Collect`): the loop streams the collected pass's tokens at
    /// the step's end, once the next pass is out.
    pub fn launches_later(&self) -> bool {
        self.calls.contains(&Call::Launch)
    }

    /// Whether a forward pass ran or finished in this step.
    pub fn progressed(&self) -> bool {
        self.progressed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Call::*;

    /// Every call of a plan, `launches` answering `Launch`.
    fn calls(order: Order, in_flight: usize, launches: bool) -> (Vec<Call>, bool) {
        run(StepPlan::new(order, in_flight), launches)
    }

    fn run(mut plan: StepPlan, launches: bool) -> (Vec<Call>, bool) {
        let mut calls = Vec::new();
        while let Some(call) = plan.next_call() {
            calls.push(call);
            if call == Launch {
                plan.launched(launches);
            }
        }
        (calls, plan.progressed())
    }

    #[test]
    fn overlap_with_a_pass_in_flight_leases_before_collecting_it_and_extends_after_the_launch() {
        for launches in [true, false] {
            let (calls, progressed) = calls(Order::Overlap, 1, launches);
            assert_eq!(calls, COLLECTING);
            assert!(progressed, "the collected pass is progress");
        }
    }

    #[test]
    fn a_collect_of_the_overlap_orders_is_followed_by_a_launch_and_a_plain_ones_is_not() {
        for order in [Order::Overlap, Order::pipelined()] {
            let mut plan = StepPlan::new(order, order.depth());
            while plan.next_call() != Some(Collect) {}
            assert!(plan.launches_later(), "{order:?}");
        }
        let mut plan = StepPlan::new(Order::Plain, 0);
        while plan.next_call() != Some(Launch) {}
        plan.launched(true);
        assert_eq!(plan.next_call(), Some(Collect));
        assert!(!plan.launches_later());
    }

    #[test]
    fn overlap_with_nothing_in_flight_extends_then_launches() {
        assert_eq!(
            calls(Order::Overlap, 0, true),
            (vec![FlushReleases, Admit, Extend, Launch], true)
        );
        assert_eq!(
            calls(Order::Overlap, 0, false),
            (
                vec![FlushReleases, Admit, Extend, Launch, RetryComplete],
                false
            )
        );
    }

    #[test]
    fn plain_awaits_its_own_pass_then_settles_without_extends() {
        assert_eq!(
            calls(Order::Plain, 0, true),
            (
                vec![
                    FlushReleases,
                    Extend,
                    Admit,
                    Launch,
                    Collect,
                    Settle { extend: false }
                ],
                true
            )
        );
        assert_eq!(
            calls(Order::Plain, 0, false),
            (
                vec![FlushReleases, Extend, Admit, Launch, RetryComplete],
                false
            )
        );
    }

    #[test]
    fn a_pass_finished_outside_a_step_is_collected_then_settled_without_extends() {
        assert_eq!(
            run(StepPlan::finish_in_flight(), true),
            (vec![Collect, Settle { extend: false }], true)
        );
    }

    #[test]
    fn pipelined_launches_up_to_its_depth_before_collecting_the_oldest() {
        for depth in 2..=MAX_PIPELINE_DEPTH {
            let order = Order::Pipelined { depth };
            // `depth` in flight: the oldest is collected before the next launch
            for launches in [true, false] {
                let (calls, progressed) = calls(order, depth as usize, launches);
                assert_eq!(calls, COLLECTING);
                assert!(progressed);
            }
            for in_flight in 1..depth as usize {
                // fewer in flight: another pass goes in, nothing is collected
                assert_eq!(
                    calls(order, in_flight, true),
                    (vec![FlushReleases, Admit, Plan, Launch], true)
                );
                // ... unless there is none to add: then the oldest is collected
                assert_eq!(
                    calls(order, in_flight, false),
                    (
                        vec![
                            FlushReleases,
                            Admit,
                            Plan,
                            Launch,
                            Collect,
                            Settle { extend: true }
                        ],
                        true
                    )
                );
            }
            for launches in [true, false] {
                assert_eq!(
                    calls(order, 0, launches),
                    calls(Order::Overlap, 0, launches)
                );
            }
        }
    }

    #[test]
    fn only_speculation_keeps_overlap_from_pipelining() {
        assert_eq!(Order::from_overlap(true, 0, 2), Order::pipelined());
        assert_eq!(
            Order::from_overlap(true, 0, 3),
            Order::Pipelined { depth: 3 }
        );
        // one pass deep is overlap; past the deepest, the deepest
        assert_eq!(Order::from_overlap(true, 0, 1), Order::Overlap);
        assert_eq!(
            Order::from_overlap(true, 0, 99),
            Order::Pipelined {
                depth: MAX_PIPELINE_DEPTH
            }
        );
        assert_eq!(Order::from_overlap(true, 3, 3), Order::Overlap);
        assert_eq!(Order::from_overlap(false, 0, 3), Order::Plain);
        for order in orders() {
            assert_eq!(
                order.lookahead() as usize,
                order.depth() - usize::from(order == Order::Plain)
            );
        }
    }

    /// Every order, each pipeline depth.
    fn orders() -> impl Iterator<Item = Order> {
        [Order::Plain, Order::Overlap]
            .into_iter()
            .chain((2..=MAX_PIPELINE_DEPTH).map(|depth| Order::Pipelined { depth }))
    }

    /// The rules the orders share, over every path: a pass is collected
    /// before it is settled, each call at most once, a step ends with its
    /// launch or after the settle of the pass it awaited, and a retry of
    /// `CompleteStep` only when nothing progressed.
    #[test]
    fn every_path_collects_before_settling_and_retries_completion_only_when_idle() {
        for order in orders() {
            for in_flight in 0..=order.depth() {
                if order == Order::Plain && in_flight > 0 {
                    continue;
                }
                for launches in [false, true] {
                    let (calls, progressed) = calls(order, in_flight, launches);
                    let at = |c: Call| calls.iter().position(|x| *x == c);
                    let settle = calls.iter().position(|c| matches!(c, Settle { .. }));
                    if let Some(settle) = settle {
                        assert!(
                            at(Collect).is_some_and(|collect| collect < settle),
                            "{order:?} settles before it collects: {calls:?}"
                        );
                    }
                    for c in &calls {
                        assert_eq!(
                            calls.iter().filter(|x| *x == c).count(),
                            1,
                            "{c:?} twice: {calls:?}"
                        );
                    }
                    assert_eq!(at(FlushReleases), Some(0), "releases go first: {calls:?}");
                    assert_eq!(
                        at(RetryComplete).is_some(),
                        !progressed,
                        "{order:?}: {calls:?}"
                    );
                    // extends are sent exactly once, alone or riding the
                    // settle (a pipelined step that only adds the second
                    // pass sends its planned ones with the next settle)
                    let extends = calls
                        .iter()
                        .filter(|c| matches!(c, Extend | Settle { extend: true }))
                        .count();
                    let deferred = order.is_pipelined()
                        && in_flight > 0
                        && in_flight < order.depth()
                        && launches;
                    assert_eq!(extends, usize::from(!deferred), "{order:?}: {calls:?}");
                    if deferred {
                        continue;
                    }
                    // the work is planned before the step's launch; its
                    // extends reach the cache before it unless the work was
                    // planned ahead (only what the leases already cover)
                    let launch = at(Launch);
                    let planned = calls
                        .iter()
                        .position(|c| matches!(c, Plan | Extend | Settle { extend: true }));
                    assert!(planned < launch, "{order:?}: {calls:?}");
                    let extend = calls
                        .iter()
                        .position(|c| matches!(c, Extend | Settle { extend: true }));
                    assert_eq!(extend > launch, at(Plan).is_some(), "{order:?}: {calls:?}");
                }
            }
        }
    }
}
