//! `kvlease cache-replay` against real cache services on loopback: the
//! service's LRU must equal the tool's reference LRU exactly, and the
//! service's online miss-ratio curve must match real replays at the sizes
//! it estimates.

use cache_svc::eviction::PolicyKind;
use kvlease::replay::conversations::Conversations;
use kvlease::replay::drive::{self, LocalCache};
use kvlease::replay::sim::{self, Victim};
use kvlease_proto::v1 as pb;

fn conversation_trace(sessions: usize, seed: u64) -> Vec<Vec<u64>> {
    Conversations {
        sessions,
        seed,
        ..Conversations::default()
    }
    .records()
    .into_iter()
    .map(|r| r.hash_ids)
    .collect()
}

#[tokio::test]
async fn service_lru_equals_the_reference_lru_block_for_block() {
    let trace = conversation_trace(150, 7);
    let chains = sim::chain_keys(&trace);
    for (capacity, concurrency) in [(48, 1), (160, 1), (400, 1), (160, 3)] {
        let reference = sim::simulate(&chains, capacity, Victim::Lru, concurrency);
        let served = drive::replay_fresh(&trace, capacity as u32, PolicyKind::Lru, concurrency)
            .await
            .map_err(|e| e.to_string());
        let served = served.unwrap_or_default();
        assert!(reference.evictions > 0, "capacity {capacity} must evict");
        assert_eq!(
            (
                served.hits,
                served.lookups,
                served.evictions,
                served.refused
            ),
            (
                reference.hits,
                reference.lookups,
                reference.evictions,
                reference.refused
            ),
            "capacity {capacity}, concurrency {concurrency}"
        );
    }
}

#[tokio::test]
async fn the_in_process_replay_equals_the_service_for_every_policy() {
    // `cache-replay --in-process` drives the core with the calls the gRPC
    // replay makes: the same figures, partial reuse on or off.
    let trace = conversation_trace(80, 11);
    let cases = [
        (64, 1, None),
        (160, 3, Some(1)),
        (48, 2, Some(1)),
        (96, 2, None),
    ];
    for (policy, (capacity, concurrency, partial)) in PolicyKind::ALL.into_iter().zip(cases) {
        let mut config = drive::service_config(policy);
        if let Some(min) = partial {
            config.partial_reuse = true;
            config.partial_min_tokens = min;
        }
        let core =
            drive::replay_core(&trace, capacity, &config, concurrency).map_err(|e| e.to_string());
        let served = drive::replay_fresh_with(&trace, capacity, config, concurrency)
            .await
            .map_err(|e| e.to_string());
        assert!(served.as_ref().is_ok_and(|s| s.evictions > 0), "{served:?}");
        assert_eq!(
            core, served,
            "{policy} at {capacity}, concurrency {concurrency}"
        );
    }
}

#[tokio::test]
async fn a_parent_left_as_a_leaf_is_evicted_by_its_own_recency() {
    // Releases stamp 1, 2, 3; [4,5] evicts leaf 2 and leaves 1 a leaf from
    // before 3; [6] then evicts 1, not 3, so the last [3] hits. The old
    // re-queue (1 made the most recent) evicted 3 and missed.
    let trace: Vec<Vec<u64>> = vec![vec![1, 2], vec![3], vec![4, 5], vec![6], vec![3]];
    let served = drive::replay_fresh(&trace, 5, PolicyKind::Lru, 1)
        .await
        .map_err(|e| e.to_string());
    assert_eq!(served.map(|s| (s.hits, s.evictions)), Ok((1, 2)));
}

#[tokio::test]
async fn every_policy_stays_between_nothing_and_the_optimum() {
    let trace = conversation_trace(150, 9);
    let chains = sim::chain_keys(&trace);
    let capacity = 160;
    let optimum = sim::simulate(&chains, capacity, Victim::Belady, 1);
    for policy in PolicyKind::ALL {
        let served = drive::replay_fresh(&trace, capacity as u32, policy, 1)
            .await
            .map_err(|e| e.to_string());
        let served = served.unwrap_or_default();
        assert_eq!(served.lookups, optimum.lookups);
        assert!(served.hits > 0, "{policy}");
        assert!(
            served.hits <= optimum.hits,
            "{policy}: {served:?} {optimum:?}"
        );
    }
}

#[tokio::test]
async fn the_miss_ratio_curve_matches_real_replays_within_two_points() {
    let trace = conversation_trace(300, 11);
    let capacity = 256u32;
    let service = LocalCache::start(drive::service_config(PolicyKind::Lru))
        .await
        .map_err(|e| e.to_string());
    let Ok(service) = service else {
        panic!("cache did not start: {service:?}");
    };
    let mut client = service.client().await.map_err(|e| e.to_string()).unwrap();
    let replayed = drive::replay(&mut client, "mrc", &trace, capacity, 1)
        .await
        .map_err(|e| e.to_string())
        .unwrap();
    let stats = client
        .get_stats(pb::GetStatsRequest {
            pool_group: "mrc".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let estimates = &stats.pools[0].hit_rate_estimates;
    assert_eq!(estimates.len(), 4);
    for e in estimates {
        assert_eq!(e.sampled_lookups, replayed.lookups, "small pools are exact");
        let real = if e.scale == 1.0 {
            replayed
        } else {
            drive::replay_fresh(&trace, e.blocks as u32, PolicyKind::Lru, 1)
                .await
                .map_err(|e| e.to_string())
                .unwrap()
        };
        println!(
            "scale {} ({} blocks): estimated {:.4}, replayed {:.4}",
            e.scale,
            e.blocks,
            e.hit_rate,
            real.hit_rate()
        );
        assert!(
            (e.hit_rate - real.hit_rate()).abs() <= 0.02,
            "scale {}: estimated {} vs replayed {}",
            e.scale,
            e.hit_rate,
            real.hit_rate()
        );
    }
    service.stop().await.unwrap();
}

#[tokio::test]
async fn a_sampled_curve_stays_within_two_points_on_a_large_pool() {
    // A pool large enough that the curve samples (rate < 1): the estimate
    // at 1x against the replay itself.
    let trace = conversation_trace(1200, 13);
    let capacity = 8192u32;
    let service = LocalCache::start(drive::service_config(PolicyKind::Lru))
        .await
        .map_err(|e| e.to_string());
    let Ok(service) = service else {
        panic!("cache did not start: {service:?}");
    };
    let mut client = service.client().await.map_err(|e| e.to_string()).unwrap();
    let replayed = drive::replay(&mut client, "mrc", &trace, capacity, 1)
        .await
        .map_err(|e| e.to_string())
        .unwrap();
    let stats = client
        .get_stats(pb::GetStatsRequest {
            pool_group: "mrc".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let at_1 = stats.pools[0]
        .hit_rate_estimates
        .iter()
        .find(|e| e.scale == 1.0)
        .cloned();
    let at_1 = at_1.unwrap_or_default();
    assert!(at_1.sampled_lookups < replayed.lookups, "sampled");
    println!(
        "sampled {} of {} lookups: estimated {:.4}, replayed {:.4}",
        at_1.sampled_lookups,
        replayed.lookups,
        at_1.hit_rate,
        replayed.hit_rate()
    );
    assert!((at_1.hit_rate - replayed.hit_rate()).abs() <= 0.02);
    service.stop().await.unwrap();
}

/// Retention hints on an agent trace (issue 28 point 5): the tool prompts,
/// hinted, survive the flood between a session's returns, so the hinted
/// replay gets strictly more hits than the same replay without hints.
#[test]
fn agent_trace_hints_buy_hits() {
    use kvlease::mooncake::MOONCAKE_BLOCK_TOKENS;
    use kvlease::replay::conversations::Agent;

    let records = Agent {
        sessions: 60,
        ..Agent::default()
    }
    .records();
    let trace: Vec<Vec<u64>> = records.iter().map(|r| r.hash_ids.clone()).collect();
    let retain: Vec<Option<u32>> = records
        .iter()
        .map(|r| {
            r.retain_tokens
                .map(|t| t / MOONCAKE_BLOCK_TOKENS * drive::REPLAY_BLOCK_TOKENS)
        })
        .collect();
    assert!(retain.iter().any(Option::is_some));
    let config = drive::service_config(PolicyKind::Lru);
    let plain = drive::replay_core(&trace, 256, &config, 1).unwrap();
    let hinted = drive::replay_core_hinted(&trace, &retain, 256, &config, 1).unwrap();
    assert!(
        hinted.hits > plain.hits,
        "hinted {} hits, unhinted {}",
        hinted.hits,
        plain.hits
    );
}
