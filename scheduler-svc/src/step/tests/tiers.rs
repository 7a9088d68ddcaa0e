//! Host-tier copies: the demotions and onboardings a grant names ride the
//! forward pass of their step, and a failed pass that carried them releases
//! with `discard_unwritten` before its step completes.

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
    // Without a host tier a failed lease call needs no such release.
    let mut plain = core(Policy::MaxUtilization, 100);
    plain.submit(request(1, 4, 8));
    plain.begin_step();
    plain.plan_admission();
    plain.leases_failed();
    assert!(!plain.take_releases().discard_unwritten);
}

#[test]
fn a_failed_pass_that_carried_demotions_discards_though_an_earlier_pass_of_its_group_returned() {
    let order = Order::pipelined();
    let mut c = Core::new(
        CoreConfig {
            lookahead: order.lookahead(),
            order,
            ..CoreConfig::default()
        },
        vec![tiered_group()],
    );
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
