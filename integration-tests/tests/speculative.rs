//! Prompt-lookup speculative decoding gives exactly the greedy output, and
//! its draft slots go back to the pool.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;

const PROMPTS: [&str; 4] = [
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the",
    "abcabcabcabcabcabcab",
    "1 2 3 4 5 1 2 3 4 5 1 2 3",
    "no repetition in here at all!",
];

async fn run(spec_draft_k: u32, cache: &Service, worker: &Service) -> (Vec<Generated>, u64) {
    let config = scheduler_svc::Config {
        spec_draft_k,
        max_context: 256,
        max_tokens: 64,
        max_seqs: 8,
        max_tokens_per_step: 192,
        ..scheduler_svc::Config::default()
    };
    let s = start_scheduler(
        config,
        &cache.url(),
        &[worker.url()],
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let client = scheduler_client(s.addr).await.unwrap();
    let mut tasks = Vec::new();
    for p in PROMPTS {
        let mut c = client.clone();
        let req = pb::GenerateRequest {
            text: p.into(),
            max_tokens: 40,
            ..Default::default()
        };
        tasks.push(tokio::spawn(async move { collect(&mut c, req).await }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().unwrap());
    }
    let steps = client
        .clone()
        .get_status(pb::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner()
        .steps;
    // checked while the session is still open (closing it reclaims everything)
    let pools = wait_whole(cache.addr, GROUP, Duration::from_secs(5))
        .await
        .unwrap();
    for p in pools {
        assert_eq!(
            (p.in_use, p.fenced),
            (0, 0),
            "k={spec_draft_k}: slots returned to pool {}",
            p.window
        );
    }
    s.stop().await.unwrap();
    (out, steps)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_output_equals_greedy_and_draft_slots_return() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let (greedy, greedy_steps) = run(0, &cache, &worker).await;
    let (spec, spec_steps) = run(4, &cache, &worker).await;
    for (i, (g, s)) in greedy.iter().zip(&spec).enumerate() {
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
        assert_eq!(s.finish_reason(), pb::FinishReason::Length, "{}", s.message);
        assert_eq!(g.tokens.len(), 40);
        assert_eq!(
            s.tokens, g.tokens,
            "prompt {i}: speculative output differs from greedy"
        );
        assert_eq!(s.text, g.text);
    }
    // drafts were accepted: fewer forward passes for the same tokens
    assert!(
        spec_steps < greedy_steps,
        "spec {spec_steps} steps, greedy {greedy_steps}"
    );
}
