//! Routing between worker groups: kv-aware (prefill after reuse plus load)
//! and least-committed, and when the core asks the cache's `Match`.

use super::*;

/// Admits `request` with `reuse` (per group) as this step's `Match`
/// answered; returns the group it went to.
fn route(c: &mut Core, request: Request, reuse: Option<[u32; 2]>) -> String {
    let id = request.id;
    c.submit(request);
    c.begin_step();
    let asked = c.match_wanted();
    if let Some(reuse) = reuse {
        assert_eq!(
            asked.iter().map(|w| w.request).collect::<Vec<_>>(),
            vec![id]
        );
        c.set_reuse(HashMap::from([(id, reuse.to_vec())]));
    }
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1);
    grant_all(c, &leases);
    for (g, items) in c.plan_forward() {
        c.apply_forward(g, results(&items, 7, false));
    }
    leases[0].pool_group.clone()
}

#[test]
fn kv_aware_routing_sends_a_request_to_the_group_holding_its_prefix() {
    let mut c = two_groups(crate::routing::Routing::KvAware);
    // 5 blocks committed on g0 (ties go to the first group)
    assert_eq!(route(&mut c, request(1, 20, 64), Some([0, 0])), "g0");
    // 80 tokens, 76 cached on g0: 1 block to prefill there against 20 on
    // the idle g1; g0 wins despite its load
    assert_eq!(route(&mut c, request(2, 80, 64), Some([76, 0])), "g0");
    // the same without a Match answer (a failed call): least committed
    assert_eq!(route(&mut c, request(3, 80, 64), None), "g1");
}

#[test]
fn kv_aware_routing_leaves_a_much_more_loaded_group() {
    let mut c = two_groups(crate::routing::Routing::KvAware);
    // 50 blocks committed on g0
    assert_eq!(route(&mut c, request(1, 200, 64), Some([0, 0])), "g0");
    // its prefix saves 2 blocks on g0 (16 at the default weight 8), the
    // load there costs 50 more
    assert_eq!(route(&mut c, request(2, 80, 64), Some([8, 0])), "g1");
}

#[test]
fn least_committed_routing_ignores_the_prefix_and_asks_no_match() {
    let mut c = two_groups(crate::routing::Routing::LeastCommitted);
    assert_eq!(route(&mut c, request(1, 20, 64), None), "g0");
    c.submit(request(2, 80, 64));
    assert!(c.match_wanted().is_empty(), "no Match for least-committed");
    c.begin_step();
    c.set_reuse(HashMap::from([(RequestId(2), vec![76, 0])]));
    let leases = c.plan_admission();
    assert_eq!(leases[0].pool_group, "g1");
}

#[test]
fn match_is_asked_for_the_queue_head_only_with_a_choice_to_make() {
    // one group: nothing to choose
    let mut one = core(Policy::MaxUtilization, 100);
    one.submit(request(1, 8, 4));
    assert!(one.match_wanted().is_empty());
    // two groups: the head, up to the free sequence slots
    let mut c = two_groups(crate::routing::Routing::KvAware);
    c.config.max_seqs = 2;
    for id in 1..=3 {
        let mut r = request(id, 8, 4);
        r.cache_salt = format!("salt-{id}");
        c.submit(r);
    }
    let wanted = c.match_wanted();
    assert_eq!(
        wanted
            .iter()
            .map(|w| (w.request.get(), w.cache_salt.as_str()))
            .collect::<Vec<_>>(),
        vec![(1, "salt-1"), (2, "salt-2")]
    );
    assert_eq!(wanted[0].context.len(), 8);
    // an answer serves one admission only
    c.set_reuse(HashMap::from([(RequestId(3), vec![4, 0])]));
    c.begin_step();
    let _ = c.plan_admission();
    assert!(c.reuse.is_empty());
}
