//! Host-tier copies: the demotions and onboardings a grant names ride the
//! group's next forward pass (the step's own, or in the overlap orders the
//! next one for the extends sent after a launch), no step from the one that
//! named them completes before that pass returned, and a failed pass that
//! carried them releases with `discard_unwritten` before its step
//! completes.

use super::*;

fn tiered_group() -> GroupGeometry {
    let mut g = group(100);
    g.pools[0].host_blocks = 400;
    g
}

fn demotion(device_block: u32, host_block: u32) -> crate::domain::TierCopy {
    crate::domain::TierCopy {
        pool_id: 1,
        window: 0,
        direction: crate::domain::TierDirection::Demote,
        device_block,
        host_block,
        disk_block: 0,
        hash: 0,
        parent: 0,
    }
}

/// A core in the pipelined order over the tiered group.
fn pipelined_tiered() -> Core {
    let order = Order::pipelined();
    Core::new(
        CoreConfig {
            lookahead: order.lookahead(),
            order,
            ..CoreConfig::default()
        },
        vec![tiered_group()],
    )
}

fn grant_with_copies(seq_id: SeqId, copies: Vec<crate::domain::TierCopy>) -> Outcome {
    match grant(seq_id) {
        Outcome::Grant(g) => Outcome::Grant(Grant {
            tier_copies: copies,
            ..g
        }),
        other => other,
    }
}

#[test]
fn tier_copies_of_a_step_ride_its_forward_even_when_their_sequence_does_not() {
    let mut c = Core::new(CoreConfig::default(), vec![tiered_group()]);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    // The request is cancelled while its lease is in flight: the grant's
    // sequence never runs, but the demotion its allocation caused must.
    c.cancel(RequestId(1), "client went away");
    c.apply_leases(vec![grant_with_copies(
        leases[0].seq_id,
        vec![demotion(3, 7)],
    )]);
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 1, "a forward of copies alone");
    assert!(batches[0].1.is_empty());
    assert_eq!(c.take_tier_copies(batches[0].0), vec![demotion(3, 7)]);
    assert!(c.take_tier_copies(batches[0].0).is_empty(), "taken once");
    c.apply_forward(batches[0].0, Vec::new());
    let release = c.take_releases();
    assert!(!release.discard_unwritten);
    c.releases_sent(release);
    assert!(c.complete_through().is_some());
}

#[test]
fn a_failed_forward_that_carried_demotions_releases_with_discard_before_completing() {
    let mut c = Core::new(CoreConfig::default(), vec![tiered_group()]);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(vec![grant_with_copies(
        leases[0].seq_id,
        vec![demotion(3, 7)],
    )]);
    let batches = c.plan_forward();
    let g = batches[0].0;
    assert_eq!(c.take_tier_copies(g).len(), 1);
    c.forward_failed(g, "worker down");
    assert_eq!(c.complete_through(), None, "not before the discard release");
    let release = c.take_releases();
    assert!(release.discard_unwritten);
    c.releases_sent(release);
    assert!(c.complete_through().is_some());
}

#[test]
fn a_lease_call_that_failed_with_a_host_tier_sends_a_discard_even_with_no_sequence() {
    let mut c = Core::new(CoreConfig::default(), vec![tiered_group()]);
    c.submit(request(1, 4, 8));
    c.begin_step();
    c.plan_admission();
    c.leases_failed();
    assert!(c.has_releases());
    let release = c.take_releases();
    assert!(release.discard_unwritten && !release.is_empty());
    // Without a host tier, the failed lease's sequence goes out the same
    // way: the cache may have leased it, and no pass wrote its prompt.
    let mut plain = core(Policy::MaxUtilization, 100);
    plain.submit(request(1, 4, 8));
    plain.begin_step();
    plain.plan_admission();
    plain.leases_failed();
    let release = plain.take_releases();
    assert!(release.discard_unwritten);
    assert_eq!(release.seq_ids, vec![SeqId(1)]);
}

#[test]
fn a_failed_pass_that_carried_demotions_discards_though_an_earlier_pass_of_its_group_returned() {
    let mut c = pipelined_tiered();
    // pass A: request 1's prompt, no copies
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(vec![grant(leases[0].seq_id)]);
    let a = c.plan_forward();
    let g = a[0].0;
    assert!(c.take_tier_copies(g).is_empty());
    // pass B, behind A: the copies alone (a demotion named by the grant of
    // request 2, cancelled while its lease was in flight), so only the
    // tier rule can tell that B's failure leaves a demotion unrun
    c.submit(request(2, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    c.cancel(RequestId(2), "client went away");
    c.apply_leases(vec![grant_with_copies(
        leases[0].seq_id,
        vec![demotion(3, 7)],
    )]);
    let b = c.plan_forward();
    assert_eq!((b[0].0, b[0].1.len()), (g, 0), "the group's pass of copies");
    assert_eq!(c.take_tier_copies(g).len(), 1);
    // A comes back whole; B, which carried the copy, fails
    c.apply_forward(g, results(&a[0].1, 5, false));
    c.forward_failed(g, "worker down");
    assert_eq!(c.complete_through(), None, "not before the discard release");
    let release = c.take_releases();
    assert!(release.discard_unwritten, "{release:?}");
}

/// A pipelined core over the tiered group with request 1 (a 4-token
/// prompt, 8 tokens at most) leased and prefilled: it decodes from here.
fn pipelined_decoding() -> Core {
    let mut c = pipelined_tiered();
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    // one block of 4, covering the prompt and the lookahead slots
    c.apply_leases(vec![Outcome::Grant(Grant {
        capacity_tokens: 4 + Order::pipelined().lookahead(),
        ..grant_of(leases[0].seq_id, vec![1])
    })]);
    let prefill = c.plan_forward();
    c.apply_forward(prefill[0].0, results(&prefill[0].1, 5, false));
    c
}

/// [`pipelined_decoding`]'s decode launched, and the settle after the
/// launch answered: its extend evicted a cached block, whose demotion it
/// names. Returns the core, the step the extend named, the group and the
/// decode's items.
fn decoding_with_a_late_demotion() -> (Core, Step, usize, Vec<ForwardItem>) {
    let mut c = pipelined_decoding();
    let named = c.begin_step();
    c.plan_extends(true);
    let mut a = c.plan_forward();
    let (g, items) = a.remove(0);
    assert_eq!(items.len(), 1, "the decode: {items:?}");
    assert!(c.take_tier_copies(g).is_empty());
    let seq = items[0].seq_id;
    c.apply_extends(named, vec![grant_with_copies(seq, vec![demotion(3, 7)])]);
    (c, named, g, items)
}

#[test]
fn a_demotion_named_by_extends_after_the_launch_rides_the_next_pass_and_holds_its_step() {
    let (mut c, named, g, a) = decoding_with_a_late_demotion();
    // its pass returns, but the copy has not run: its step is held
    c.apply_forward(g, results(&a, 6, false));
    assert!(
        c.complete_through().is_none_or(|s| s < named),
        "{:?}",
        c.complete_through()
    );
    assert!(!c.is_quiet());
    // the next step's pass carries it, though the answer came late
    c.begin_step();
    c.plan_extends(true);
    let b = c.plan_forward();
    assert_eq!(b[0].0, g);
    assert_eq!(c.take_tier_copies(g), vec![demotion(3, 7)]);
    assert!(c.complete_through().is_none_or(|s| s < named));
    c.apply_forward(g, results(&b[0].1, 7, false));
    assert_eq!(c.complete_through(), Some(c.step()), "both steps complete");
    assert!(!c.take_releases().discard_unwritten, "nothing was dropped");
}

#[test]
fn late_copies_of_a_group_with_nothing_to_run_get_a_pass_of_their_own() {
    let (mut c, _, g, a) = decoding_with_a_late_demotion();
    c.cancel(RequestId(1), "client went away");
    c.apply_forward(g, results(&a, 6, false));
    let release = c.take_releases();
    c.releases_sent(release);
    assert!(c.is_idle());
    assert!(!c.is_quiet(), "a copy waits for a pass");
    c.begin_step();
    let b = c.plan_forward();
    assert_eq!((b.len(), b[0].0, b[0].1.len()), (1, g, 0), "copies alone");
    assert_eq!(c.take_tier_copies(g).len(), 1);
    c.apply_forward(g, Vec::new());
    let through = c.complete_through();
    assert_eq!(through, Some(c.step()));
    c.step_completed(c.step());
    assert!(c.is_quiet());
}

#[test]
fn a_failed_pass_that_carried_late_copies_discards_before_their_step_completes() {
    let (mut c, _, g, a) = decoding_with_a_late_demotion();
    c.apply_forward(g, results(&a, 6, false));
    c.begin_step();
    c.plan_extends(true);
    c.plan_forward();
    assert_eq!(c.take_tier_copies(g).len(), 1);
    c.forward_failed(g, "worker down");
    assert_eq!(c.complete_through(), None, "not before the discard release");
    let release = c.take_releases();
    assert!(release.discard_unwritten, "{release:?}");
    c.releases_sent(release);
    assert!(c.complete_through().is_some());
}

#[test]
fn a_lost_session_forgets_the_copies_it_named() {
    let (mut c, _, g, _) = decoding_with_a_late_demotion();
    c.leases_lost(false, "cache restarted");
    c.drain_outputs();
    // the old session's copies never reach a pass of the new one
    c.begin_step();
    let b = c.plan_forward();
    assert!(b.is_empty(), "{b:?}");
    assert!(c.take_tier_copies(g).is_empty());
}

#[test]
fn copies_no_pass_will_carry_are_abandoned_with_a_discard_before_their_step_completes() {
    // the loop stops: the last settle's copies will ride no pass
    let (mut c, named, g, a) = decoding_with_a_late_demotion();
    c.apply_forward(g, results(&a, 6, false));
    assert!(c.complete_through().is_none_or(|s| s < named));
    c.abandon_tier_copies();
    assert_eq!(c.complete_through(), None, "not before the discard release");
    let release = c.take_releases();
    assert!(release.discard_unwritten, "{release:?}");
    c.releases_sent(release);
    assert_eq!(c.complete_through(), Some(named));
    c.begin_step();
    assert!(c.take_tier_copies(g).is_empty(), "nothing left to carry");
}

#[test]
fn a_completion_not_acknowledged_waits_for_copies_named_at_its_step_and_extends_follow_it() {
    let mut c = pipelined_decoding();
    let s = c.begin_step();
    c.plan_extends(true);
    let mut a = c.plan_forward();
    let (g, items) = a.remove(0);
    c.apply_forward(g, results(&items, 6, false));
    // the extends that follow a completion name its step: not in one call
    // (without a host tier no demotion is named, and the completion goes
    // first, so that the extends find its fenced blocks)
    assert_eq!(c.complete_before(Some(s)), None);
    let mut plain = core(Policy::MaxUtilization, 100);
    plain.submit(request(1, 4, 8));
    let p = plain.begin_step();
    let leases = plain.plan_admission();
    plain.apply_leases(vec![grant(leases[0].seq_id)]);
    let prefill = plain.plan_forward();
    plain.apply_forward(prefill[0].0, results(&prefill[0].1, 5, false));
    assert_eq!(plain.complete_before(Some(p)), Some(p));
    // CompleteStep(s) went out and was not answered; then extends at s
    // name a copy (the refused order's calls one by one)
    assert_eq!(c.complete_through(), Some(s));
    c.apply_extends(
        s,
        vec![grant_with_copies(items[0].seq_id, vec![demotion(3, 7)])],
    );
    assert_eq!(c.complete_through(), None, "held until the copy ran");
    c.begin_step();
    c.plan_extends(true);
    let b = c.plan_forward();
    assert_eq!(c.take_tier_copies(g).len(), 1);
    c.apply_forward(g, results(&b[0].1, 7, false));
    assert_eq!(c.complete_through(), Some(c.step()));
}
