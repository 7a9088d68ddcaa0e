//! Requests that go away and leases that are lost: cancellation, lost
//! leases after a cache restart (recompute or reject), failed forward passes
//! and failing workers.

use super::*;

#[test]
fn cancelled_running_request_is_released_and_finished() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    step_granting(&mut c, 1);
    c.cancel(RequestId(2), "client went away");
    c.cancel(RequestId(99), "unknown is fine");
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(2)]);
    let out = c.drain_outputs();
    assert!(matches!(finishes(&out)[..], [(2, Finish::Cancelled(_))]));
    let b = step_granting(&mut c, 1);
    assert_eq!(
        b.iter().map(|i| i.seq_id.get()).collect::<Vec<_>>(),
        vec![1]
    );
}

#[test]
fn cancel_during_lease_releases_the_grant() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    c.cancel(RequestId(1), "gone");
    grant_all(&mut c, &leases);
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(1)]);
    assert!(c.is_idle());
}

#[test]
fn lost_leases_are_recomputed_with_their_tokens() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    step_granting(&mut c, 5);
    step_granting(&mut c, 6);
    c.leases_lost(
        true,
        "stale epoch 1: the cache service restarted, current epoch is 2",
    );
    assert_eq!(c.take_releases().seq_ids, Vec::<SeqId>::new());
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases[0].prompt_tokens[4..], [5, 6]);
}

#[test]
fn forward_failure_with_no_requeues_left_ends_in_flight_requests_with_error() {
    let config = CoreConfig {
        max_preemptions: 0,
        ..CoreConfig::default()
    };
    let mut c = core_with(config);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    grant_all(&mut c, &leases);
    let batches = c.plan_forward();
    c.forward_failed(batches[0].0, "worker down");
    assert!(matches!(
        finishes(&c.drain_outputs())[..],
        [(1, Finish::Error(_))]
    ));
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(1)]);
}

#[test]
fn a_failed_worker_takes_no_new_requests_the_other_replica_does() {
    let config = CoreConfig {
        policy: Policy::MaxUtilization,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, two_group_geometries());
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases[0].pool_group, "g0");
    grant_all(&mut c, &leases);
    let batches = c.plan_forward();
    c.forward_failed(batches[0].0, "connection refused");
    // The request does not end: its blocks are released and it is requeued.
    assert!(finishes(&c.drain_outputs()).is_empty());
    assert_eq!(c.counters().preempted_by(PreemptCause::WorkerFailed), 1);
    assert_eq!(c.take_releases().seq_ids.len(), 1);
    // It and new requests go to the replica that still answers, even though
    // g0 is emptier.
    c.submit(request(2, 4, 8));
    c.submit(request(3, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 3);
    assert!(leases.iter().all(|l| l.pool_group == "g1"), "{leases:?}");
    grant_all(&mut c, &leases);
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 1);
    c.apply_forward(batches[0].0, results(&batches[0].1, 5, false));
    assert!(finishes(&c.drain_outputs()).is_empty());
}

#[test]
fn a_request_whose_worker_keeps_failing_ends_with_an_error_naming_the_group() {
    let config = CoreConfig {
        policy: Policy::MaxUtilization,
        max_preemptions: 1,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, two_group_geometries());
    c.submit(request(1, 4, 8));
    for (attempt, name) in ["g0", "g1"].into_iter().enumerate() {
        c.begin_step();
        let leases = c.plan_admission();
        assert_eq!(leases.len(), 1, "attempt {attempt}");
        assert_eq!(leases[0].pool_group, name);
        grant_all(&mut c, &leases);
        let batches = c.plan_forward();
        c.forward_failed(batches[0].0, "connection refused");
        assert_eq!(c.take_releases().seq_ids.len(), 1);
    }
    let ended = finishes(&c.drain_outputs());
    assert!(
        matches!(&ended[..], [(1, Finish::Error(m))] if m.contains("g1") && m.contains("connection refused")),
        "{ended:?}"
    );
}

#[test]
fn lost_leases_can_be_rejected_cleanly() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    step_granting(&mut c, 5);
    c.cancel(RequestId(2), "gone");
    c.drain_outputs();
    c.leases_lost(
        false,
        "stale epoch 1: the cache service restarted, current epoch is 2",
    );
    let out = c.drain_outputs();
    assert!(
        matches!(&finishes(&out)[..], [(1, Finish::Rejected(r))] if r.message.contains("restarted"))
    );
    assert!(
        c.take_releases().is_empty(),
        "the old session's releases are moot"
    );
    assert!(c.is_idle());
}

#[test]
fn a_lease_lost_with_an_expired_session_says_the_session_expired() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    step_granting(&mut c, 5);
    c.drain_outputs();
    c.leases_lost(
        false,
        "session expired: session 3 missed its keep-alive and was reclaimed",
    );
    let out = c.drain_outputs();
    let [(1, Finish::Rejected(r))] = &finishes(&out)[..] else {
        panic!("{out:?}");
    };
    // the protocol's reason stays CACHE_RESTARTED; the message tells the truth
    assert_eq!(r.reason, RejectReason::CacheRestarted);
    assert_eq!(
        r.message,
        "the scheduler's cache session was lost (session expired: session 3 missed its keep-alive and was reclaimed), and the lease with it"
    );
}

#[test]
fn live_sequences_lost_to_a_cache_restart_in_reject_mode_end_rejected_cache_restarted() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    step_granting(&mut c, 5);
    c.submit(request(3, 4, 8)); // queued: kept, leased again later
    c.drain_outputs();
    c.leases_lost(
        false,
        "stale epoch 1: the cache service restarted, current epoch is 2",
    );
    let ended = finishes(&c.drain_outputs());
    assert_eq!(ended.len(), 2, "{ended:?}");
    for (_, finish) in &ended {
        assert!(
            matches!(finish, Finish::Rejected(r) if r.reason == RejectReason::CacheRestarted
                && r.reason.protocol_name() == "CACHE_RESTARTED"),
            "{finish:?}"
        );
    }
    assert_eq!(c.queued(), 1);
}
