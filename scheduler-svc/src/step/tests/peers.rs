//! Peer pull: a grant's peer copies go to the worker with the lease step's
//! first chunk, from the address of the source group; a pull that failed
//! fails only its sequence, which is released with its unwritten blocks
//! discarded and recomputed without a pull; routing weighs the tokens a
//! pull would bring by what it saves. A group of another scheduler's is
//! pulled from only where `peer_workers` names its worker.

use super::*;
use crate::domain::{PeerCopy, PeerRates};
use crate::step::routing::peer_weight;

const RATES: PeerRates = PeerRates {
    link_bytes_per_s: 1_000_000_000,
    prefill_tokens_per_s: 1_000,
    overhead_us: 100,
};

/// Two groups whose workers listen at `w0` and `w1`, with peer pull on.
fn peered() -> Core {
    let mut groups = two_group_geometries();
    for (i, g) in groups.iter_mut().enumerate() {
        g.peer = crate::domain::PeerProfile {
            key: "m".into(),
            block_bytes: vec![4_096],
            address: format!("http://w{i}"),
        };
    }
    let config = CoreConfig {
        peer_pull: Some(RATES),
        routing: crate::routing::RoutingConfig {
            policy: crate::routing::Routing::LeastCommitted,
            ..Default::default()
        },
        ..CoreConfig::default()
    };
    Core::new(config, groups)
}

/// A grant in g1 (pool 2) of blocks 10..13 whose first two come from g0's
/// blocks 5 and 6.
fn pulled_grant(seq_id: SeqId) -> Outcome {
    let mut g = grant_of(seq_id, vec![10, 11, 12]);
    g.tables[0].pool_id = 2;
    g.reused_tokens = 8;
    g.peer_blocks = 2;
    g.peer_copies = [(5, 10), (6, 11)]
        .into_iter()
        .map(|(src_block, dst_block)| PeerCopy {
            window: 0,
            dst_block,
            src_group: "g0".into(),
            src_block,
            transfer_id: 9,
            tokens: 0,
        })
        .collect();
    Outcome::Grant(g)
}

/// Admits one request of a 10-token prompt in g1 (the first lease of a
/// least-committed core goes to g0, so the second request is this one).
fn admit_in_g1(c: &mut Core) -> (Step, LeaseSpec, Vec<ForwardItem>) {
    c.submit(request(1, 10, 4));
    c.submit(request(2, 10, 4));
    let step = c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 2);
    assert!(
        leases.iter().all(|l| l.peer_pull == Some(RATES)),
        "{leases:?}"
    );
    let l = leases[1].clone();
    assert_eq!(l.pool_group, "g1");
    c.apply_leases(vec![grant(leases[0].seq_id), pulled_grant(l.seq_id)]);
    let mut items = Vec::new();
    for (g, batch) in c.plan_forward() {
        if g == 1 {
            items = batch;
        } else {
            c.apply_forward(g, results(&batch, 7, false));
        }
    }
    (step, l, items)
}

#[test]
fn a_grants_peer_copies_are_pulled_in_its_first_pass_from_the_source_groups_worker() {
    let mut c = peered();
    let (_, l, items) = admit_in_g1(&mut c);
    let item = &items[0];
    assert_eq!(item.seq_id, l.seq_id);
    // the pass computes only what follows the pulled blocks
    assert_eq!((item.start_pos, item.tokens.len()), (8, 2));
    let pull = item.peer_pull.as_ref().unwrap();
    assert_eq!(pull.address, "http://w0");
    assert_eq!(pull.transfer_id, 9);
    assert_eq!(pull.blocks, vec![(0, 5, 10, 0), (0, 6, 11, 0)]);
    c.apply_forward(1, results(&items, 7, false));
    // the next pass is a decode with no pull
    c.begin_step();
    c.plan_extends(false);
    let next = c.plan_forward();
    assert!(
        next.iter()
            .flat_map(|(_, b)| b)
            .all(|i| i.peer_pull.is_none())
    );
}

#[test]
fn a_failed_pull_fails_only_its_sequence_which_is_recomputed_without_a_pull() {
    let mut c = peered();
    let (_, l, items) = admit_in_g1(&mut c);
    let mut answers = results(&items, 7, false);
    answers[0].error = Some("cannot reach the source worker".into());
    c.apply_forward(1, answers);
    // released apart, with its unwritten blocks discarded
    let batch = c.take_releases();
    assert!(batch.discard_unwritten);
    assert_eq!(batch.seq_ids, vec![l.seq_id]);
    c.releases_sent(batch);
    // the other request runs on; this one is back in the queue, leased
    // again with no peer pull
    assert_eq!(c.queued(), 1);
    c.begin_step();
    c.plan_extends(false);
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].request, RequestId(2));
    assert_eq!(leases[0].peer_pull, None);
}

/// Admits one 10-token request (in g0) whose grant copies two blocks from
/// `src_group`; the item of its first pass.
fn first_pass_copying_from(c: &mut Core, src_group: &str) -> ForwardItem {
    c.submit(request(1, 10, 4));
    c.begin_step();
    let leases = c.plan_admission();
    let mut g = match pulled_grant(leases[0].seq_id) {
        Outcome::Grant(g) => g,
        other => panic!("{other:?}"),
    };
    for copy in &mut g.peer_copies {
        copy.src_group = src_group.into();
    }
    c.apply_leases(vec![Outcome::Grant(g)]);
    c.plan_forward().remove(0).1.remove(0)
}

#[test]
fn copies_from_a_group_of_no_worker_we_know_are_computed_instead() {
    let item = first_pass_copying_from(&mut peered(), "someone-elses");
    // from the first pulled block: the pass writes what the cache expects
    assert_eq!((item.start_pos, item.tokens.len()), (0, 10));
    assert!(item.peer_pull.is_none());
}

#[test]
fn copies_from_another_schedulers_group_named_in_peer_workers_are_pulled_from_its_worker() {
    let mut c = peered();
    c.config.peer_workers = vec![("b/m/replica-0".into(), "http://elsewhere:1".into())];
    let item = first_pass_copying_from(&mut c, "b/m/replica-0");
    // the pass computes only what follows the pulled blocks
    assert_eq!((item.start_pos, item.tokens.len()), (8, 2));
    let pull = item.peer_pull.as_ref().unwrap();
    assert_eq!(pull.address, "http://elsewhere:1");
    assert_eq!(pull.blocks, vec![(0, 5, 10, 0), (0, 6, 11, 0)]);
}

#[test]
fn routing_counts_the_tokens_a_pull_would_bring_at_what_it_saves() {
    // 4 tokens at 1000 tok/s compute in 4 ms; 4096 bytes at 1 GB/s pull
    // in 4.096 us: a pulled block is worth 0.998976 of a reused one
    let w = peer_weight(&RATES, 4_096, 4);
    assert!((w - 0.998_976).abs() < 1e-9, "{w}");
    // a link so slow that pulling costs more saves nothing
    let slow = PeerRates {
        link_bytes_per_s: 1_000,
        ..RATES
    };
    assert_eq!(peer_weight(&slow, 4_096, 4), 0.0);
    assert_eq!(peer_weight(&RATES, 0, 4), 0.0);
    // 80 tokens, 76 of them a pull away in g1: g1's cost counts them
    let mut c = peered();
    c.config.routing.policy = crate::routing::Routing::KvAware;
    c.submit(request(1, 80, 4));
    c.begin_step();
    c.set_matches(HashMap::from([(RequestId(1), vec![(0, 0), (0, 76)])]));
    let leases = c.plan_admission();
    assert_eq!(leases[0].pool_group, "g1");
}

#[test]
fn later_leases_and_routing_weigh_pulls_at_the_rates_the_workers_measured() {
    let mut c = peered();
    let (_, _, items) = admit_in_g1(&mut c);
    // the pull moved 4 MB in 2 ms (2 GB/s); its pass is no prefill sample
    c.apply_forward(
        1,
        crate::domain::ForwardAnswer {
            results: results(&items, 7, false),
            compute_us: 2_500,
            pulls: vec![(4_000_000, 2_000)],
        },
    );
    let measured = c.peer_rates().unwrap();
    assert_eq!(measured.link_bytes_per_s, 2_000_000_000);
    assert_eq!(measured.prefill_tokens_per_s, RATES.prefill_tokens_per_s);
    // a prefill pass of 300 prompt tokens in 3 ms
    c.submit(request(3, 300, 4));
    c.begin_step();
    c.plan_extends(false);
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1);
    assert_eq!(
        leases[0].peer_pull,
        Some(measured),
        "the lease carries what was measured"
    );
    let g = if leases[0].pool_group == "g0" { 0 } else { 1 };
    c.apply_leases(vec![grant(leases[0].seq_id)]);
    for (group, batch) in c.plan_forward() {
        let compute_us = if group == g { 3_000 } else { 0 };
        c.apply_forward(
            group,
            crate::domain::ForwardAnswer {
                results: results(&batch, 7, false),
                compute_us,
                pulls: Vec::new(),
            },
        );
    }
    let rates = c.peer_rates().unwrap();
    // 300 prompt tokens and the decode row of the sequence already there
    assert_eq!(rates.prefill_tokens_per_s, 100_333, "{rates:?}");
    assert_eq!(rates.link_bytes_per_s, 2_000_000_000);
    assert_eq!(rates.overhead_us, RATES.overhead_us);
    // recomputing is 100x faster than the flags said: a pull saves less
    assert!(peer_weight(&rates, 4_096, 16) < peer_weight(&RATES, 4_096, 16));
}
