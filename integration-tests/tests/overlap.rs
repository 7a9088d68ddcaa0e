//! Overlap mode: step N+1 is scheduled while step N's forward pass runs, so
//! a block released during step N must not be handed to another sequence
//! before step N's forward pass returned, and a sequence that ends while a
//! pass of it runs is released only once that pass returned. Recording
//! taps in front of the real cache and worker show when each block changed
//! hands.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use futures::StreamExt;
use kvlease_integration_tests::tap::{Event, start_taps};
use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;

/// (pool, block) pairs.
type Blocks = Vec<(u32, u32)>;
/// Each sequence of a forward pass with its blocks.
type SeqBlocks = Vec<(u64, Blocks)>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_released_at_step_n_waits_for_step_n_forward() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let (cache_tap, worker_tap, log) =
        start_taps(cache.addr, worker.addr, Duration::from_millis(10))
            .await
            .unwrap();
    let config = scheduler_svc::Config {
        overlap: true,
        max_context: 256,
        max_tokens: 64,
        max_seqs: 16,
        max_tokens_per_step: 192,
        ..scheduler_svc::Config::default()
    };
    let s = start_scheduler(
        config,
        &cache_tap.url(),
        &[worker_tap.url()],
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let client = scheduler_client(s.addr).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..24u32 {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let req = pb::GenerateRequest {
                tokens: (0..40).map(|t| (t * 3 + i * 17) % 250 + 1).collect(),
                max_tokens: 32,
                // no sharing: a block is only ever one sequence's
                cache_salt: format!("tenant-{i}"),
                ..Default::default()
            };
            let mut stream = c.generate(req).await?.into_inner();
            let mut seen = 0;
            while let Some(m) = stream.next().await {
                let m = m?;
                seen += 1;
                // every other client goes away mid-generation
                if i % 2 == 1 && seen == 3 {
                    return Ok::<_, tonic::Status>(None);
                }
                if m.finish_reason != 0 {
                    return Ok(Some(m.finish_reason));
                }
            }
            Ok(None)
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    let mut c = client.clone();
    let status = c
        .get_status(pb::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.cancelled, 12, "{status:?}");
    let pools = wait_whole(cache.addr, GROUP, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        pools.iter().all(|p| p.in_use == 0 && p.fenced == 0),
        "{pools:?}"
    );
    s.stop().await.unwrap();

    let events = log.events();
    let forwards: Vec<(u64, u64, u64, &SeqBlocks)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Forward {
                start,
                end,
                step,
                seqs,
            } => Some((*start, *end, *step, seqs)),
            _ => None,
        })
        .collect();
    let acquired: Vec<(u64, u64, &Blocks)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Acquired {
                at, seq, blocks, ..
            } => Some((*at, *seq, blocks)),
            _ => None,
        })
        .collect();
    // A sequence is released only once every pass that ran it returned
    // (its extends may have reported what those passes write); a release
    // while other passes run is fenced at the newest of them; the released
    // blocks go on to other sequences afterwards.
    let mut fenced_releases = 0;
    let mut handed_on_later = 0;
    for e in &events {
        let Event::Released { at, seqs, fence } = e else {
            continue;
        };
        for &(start, end, step, fseqs) in &forwards {
            if !(start < *at && *at < end) {
                continue;
            }
            assert!(
                !fseqs.iter().any(|(s, _)| seqs.contains(s)),
                "a sequence of step {step} was released while that pass ran"
            );
            fenced_releases += 1;
            assert!(
                fence.is_some_and(|f| f >= step),
                "release during step {step} not fenced: {fence:?}"
            );
        }
        for seq in seqs {
            // its blocks, as its last pass read them
            let blocks = forwards
                .iter()
                .rev()
                .find_map(|(_, _, _, fseqs)| fseqs.iter().find(|(s, _)| s == seq));
            let Some((_, blocks)) = blocks else {
                continue;
            };
            handed_on_later += acquired
                .iter()
                .filter(|&&(a, other, got)| {
                    other != *seq && a > *at && got.iter().any(|b| blocks.contains(b))
                })
                .count();
        }
    }
    assert!(
        fenced_releases > 0,
        "the scenario happened: releases while a forward pass ran"
    );
    assert!(
        handed_on_later > 0,
        "and released blocks were handed on afterwards"
    );
    // and in general: no block of a running forward pass is handed to
    // another sequence while that pass runs
    for &(start, end, step, fseqs) in &forwards {
        for (seq, blocks) in fseqs {
            for &(a, other, got) in &acquired {
                if other != *seq && start < a && a < end {
                    assert!(
                        !got.iter().any(|b| blocks.contains(b)),
                        "step {step}: seq {other} got a block of seq {seq} mid-forward"
                    );
                }
            }
        }
    }
    cache_tap.stop().await.unwrap();
    worker_tap.stop().await.unwrap();
}

/// Runs `requests` at once through a fresh cluster with `overlap` (and
/// `depth` passes in flight when it pipelines) and returns each one's
/// outcome, in order. No Forward call may fail: a failed pass (a decode fed
/// from a pass its sequence sat out, say) is redone and gives the same
/// tokens, late.
async fn serve_all(
    (overlap, depth): (bool, u32),
    requests: &[pb::GenerateRequest],
) -> Vec<Generated> {
    let config = scheduler_svc::Config {
        overlap,
        pipeline_depth: depth,
        max_context: 256,
        max_tokens: 64,
        max_seqs: 16,
        max_tokens_per_step: 192,
        prefill_chunk: 32,
        ..scheduler_svc::Config::default()
    };
    let cluster = SmallCluster::start(config).await.unwrap();
    let client = cluster.client().await.unwrap();
    let tasks: Vec<_> = requests
        .iter()
        .cloned()
        .map(|req| {
            let mut c = client.clone();
            tokio::spawn(async move { collect(&mut c, req).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().unwrap());
    }
    assert_cache_sound(cluster.cache.addr, GROUP, Duration::from_secs(10))
        .await
        .unwrap();
    let failed = kvlease_integration_tests::metric_value(
        &cluster.worker,
        kvlease_telemetry::metrics::names::WORKER_FORWARD_REJECTED_TOTAL,
    )
    .await
    .unwrap();
    assert_eq!(
        failed, 0.0,
        "{overlap}, depth {depth}: Forward calls failed"
    );
    cluster.stop().await.unwrap();
    out
}

/// Pipelined decode (overlap without speculation: pass N+1 sent before pass
/// N's answer, its decodes fed the tokens N samples on the worker) gives
/// every request the tokens the plain order gives, whether it runs to its
/// length or stops on a token mid-pipeline (its next pass already sent),
/// with prompts over several prefill chunks, and leaves every pool whole;
/// two, three and four passes deep alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_decode_gives_the_plain_orders_tokens_and_leaves_the_pools_whole() {
    let mut requests: Vec<pb::GenerateRequest> = (0..20u32)
        .map(|i| pb::GenerateRequest {
            tokens: (0..(5 + i * 7))
                .map(|t| (t * 11 + i * 29) % 250 + 1)
                .collect(),
            max_tokens: 8 + i % 5 * 6,
            cache_salt: format!("tenant-{}", i % 3),
            ignore_eos: true,
            ..Default::default()
        })
        .collect();
    const PLAIN: (bool, u32) = (false, 2);
    let plain = serve_all(PLAIN, &requests).await;
    // half the requests stop on their fourth token instead
    for (req, g) in requests.iter_mut().zip(&plain).step_by(2) {
        assert!(g.tokens.len() >= 4, "{g:?}");
        req.stop_tokens = vec![g.tokens[3]];
    }
    let stopping = serve_all(PLAIN, &requests).await;
    for (i, s) in stopping.iter().enumerate() {
        let want = if i % 2 == 0 {
            pb::FinishReason::Stop
        } else {
            pb::FinishReason::Length
        };
        assert_eq!(s.finish_reason(), want, "request {i}: {}", s.message);
    }
    for depth in 2..=4 {
        let piped = serve_all((true, depth), &requests).await;
        for (i, (s, p)) in stopping.iter().zip(&piped).enumerate() {
            assert_eq!(p.tokens, s.tokens, "depth {depth}, request {i}");
            assert_eq!(
                p.finish_reason(),
                s.finish_reason(),
                "depth {depth}, request {i}: {}",
                p.message
            );
        }
    }
}
