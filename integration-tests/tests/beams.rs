//! Beam search (`GenerateRequest.beam_width`) over real gRPC (cache, CPU f32
//! worker, scheduler on loopback ports), in the plain and the pipelined
//! order: width 4 answers, token for token, what a beam search written here
//! over the worker's dense reference model answers (so the KV the beams
//! share and copy on write is what computing each beam's context gives,
//! and every beam is fed the token the search chose); the beams forked
//! (the cache's fork figures); every field beams refuse is
//! INVALID_ARGUMENT naming it; and an over-subscribed run of beam requests,
//! preempting, rejecting or reserving every beam's life (GUARANTEED_NO_EVICT),
//! ends every rank and leaves the pools whole with
//! nothing for the audit to reclaim.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::collections::HashMap;
use std::time::Duration;

use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use scheduler_svc::policy::{OnExhausted, Policy};
use tonic::transport::Channel;
use worker_svc::reference::DenseModel;

const WITHIN: Duration = Duration::from_secs(60);
const WIDTH: usize = 4;

/// One rank of a beam request's answer.
#[derive(Debug, Default, Clone, PartialEq)]
struct Ranked {
    tokens: Vec<u32>,
    finish: i32,
    cumulative_logprob: Option<f32>,
    messages: usize,
}

async fn ranks(
    client: &mut SchedulerClient<Channel>,
    request: pb::GenerateRequest,
) -> Result<Vec<Ranked>, tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut by: Vec<Ranked> = Vec::new();
    while let Some(msg) = stream.message().await? {
        let i = msg.index as usize;
        if by.len() <= i {
            by.resize(i + 1, Ranked::default());
        }
        let r = &mut by[i];
        assert_eq!(r.finish, 0, "a message after rank {i}'s last: {msg:?}");
        r.messages += 1;
        r.tokens.extend(&msg.tokens);
        r.finish = msg.finish_reason;
        r.cumulative_logprob = msg.cumulative_logprob;
    }
    Ok(by)
}

/// log_softmax of `row`, in f64, from the definition.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
    row.iter().map(|&l| l as f64 - max - sum.ln()).collect()
}

/// A finished hypothesis of the reference search.
#[derive(Debug, Clone)]
struct Hyp {
    tokens: Vec<u32>,
    logprob: f64,
    stopped: bool,
}

impl Hyp {
    fn score(&self) -> f64 {
        self.logprob / self.tokens.len() as f64
    }
}

/// Beam search as the API documents it (transformers' num_beams, length
/// penalty 1.0, early_stopping false), written here over dense logits:
/// each beam's 2 * width best tokens, the best 2 * width candidates by
/// cumulative logprob (ties: the better beam, the lower token), stop
/// tokens among the first width finish, the first width others go on (or
/// finish at max_tokens); hypotheses score logprob / length, width kept;
/// done when the worst kept is at least the best live beam's score.
fn reference(model: &DenseModel<'_>, prompt: &[u32], stop: &[u32], max_tokens: usize) -> Vec<Hyp> {
    let mut live: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 0.0)];
    let mut hyps: Vec<Hyp> = Vec::new();
    let worst = |h: &[Hyp]| h.iter().map(Hyp::score).fold(f64::INFINITY, f64::min);
    loop {
        let mut cands: Vec<(f64, usize, u32)> = Vec::new();
        for (b, (generated, lp)) in live.iter().enumerate() {
            let mut seq = model.sequence();
            let context: Vec<u32> = prompt.iter().chain(generated).copied().collect();
            let rows = model.forward(&mut seq, &context);
            let row = log_softmax(rows.last().unwrap());
            let mut order: Vec<u32> = (0..row.len() as u32).collect();
            order.sort_by(|&x, &y| {
                (row[y as usize] as f32)
                    .total_cmp(&(row[x as usize] as f32))
                    .then(x.cmp(&y))
            });
            for &t in order.iter().take(2 * WIDTH) {
                // the worker reports f32 logprobs
                cands.push((lp + f64::from(row[t as usize] as f32), b, t));
            }
        }
        cands.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        let mut next = Vec::new();
        let mut ended_at_length = 0;
        for (rank, &(lp, b, t)) in cands.iter().take(2 * WIDTH).enumerate() {
            if next.len() + ended_at_length >= WIDTH {
                break;
            }
            let mut tokens = live[b].0.clone();
            tokens.push(t);
            let (stopped, at_length) = (stop.contains(&t), tokens.len() >= max_tokens);
            if stopped && rank >= WIDTH {
                continue;
            }
            if stopped || at_length {
                ended_at_length += usize::from(!stopped);
                let h = Hyp {
                    tokens,
                    logprob: lp,
                    stopped,
                };
                if hyps.len() < WIDTH || h.score() > worst(&hyps) {
                    hyps.push(h);
                    if hyps.len() > WIDTH {
                        // the worst; of equals, the latest
                        let w = (0..hyps.len())
                            .rev()
                            .min_by(|&a, &b| {
                                hyps[a].score().total_cmp(&hyps[b].score()).then(b.cmp(&a))
                            })
                            .unwrap();
                        hyps.remove(w);
                    }
                }
            } else {
                next.push((tokens, lp));
            }
        }
        let done = match next.first() {
            None => true,
            Some((tokens, lp)) => hyps.len() >= WIDTH && worst(&hyps) >= lp / tokens.len() as f64,
        };
        if done {
            hyps.sort_by(|a, b| b.score().total_cmp(&a.score()));
            return hyps;
        }
        live = next;
    }
}

fn fork_copies(pools: &[pb::PoolStats]) -> u64 {
    pools.iter().map(|p| p.fork_copies).sum()
}

async fn width_four_equals_the_reference(overlap: bool) {
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        overlap,
        ..scheduler_svc::Config::default()
    };
    let cluster = SmallCluster::start(config).await.unwrap();
    let weights = small_worker().load_weights().unwrap();
    let model = DenseModel::new(&weights);
    let mut client = cluster.client().await.unwrap();
    let before = fork_copies(&pool_stats(cluster.cache.addr, GROUP).await.unwrap());
    let mut stopped_seen = 0;
    for (k, len) in [(0u32, 21usize), (1, 7), (2, 33)] {
        let prompt: Vec<u32> = (0..len as u32)
            .map(|i| (i * 7 + 3 + 40 * k) % 250 + 1)
            .collect();
        // a stop token the search meets: the 2nd most likely first token
        let first = {
            let mut seq = model.sequence();
            let rows = model.forward(&mut seq, &prompt);
            let row = log_softmax(rows.last().unwrap());
            let mut order: Vec<u32> = (0..row.len() as u32).collect();
            order.sort_by(|&x, &y| row[y as usize].total_cmp(&row[x as usize]));
            order[1]
        };
        let stop = vec![first];
        let max_tokens = 8;
        let want = reference(&model, &prompt, &stop, max_tokens);
        let request = pb::GenerateRequest {
            tokens: prompt.clone(),
            max_tokens: max_tokens as u32,
            ignore_eos: true,
            stop_tokens: stop.clone(),
            beam_width: WIDTH as u32,
            n: WIDTH as u32,
            ..Default::default()
        };
        let got = tokio::time::timeout(WITHIN, ranks(&mut client, request.clone()))
            .await
            .expect("the search ends")
            .unwrap();
        assert_eq!(got.len(), want.len().min(WIDTH), "{got:?} vs {want:?}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.tokens, w.tokens,
                "prompt {k} rank {i}: {got:?} vs {want:?}"
            );
            let finish = if w.stopped {
                stopped_seen += 1;
                pb::FinishReason::Stop
            } else {
                pb::FinishReason::Length
            };
            assert_eq!(g.finish, finish as i32, "rank {i}");
            let lp = f64::from(g.cumulative_logprob.expect("a hypothesis's logprob"));
            assert!(
                (lp - w.logprob).abs() < 1e-3,
                "rank {i}: {lp} vs {}",
                w.logprob
            );
            // nothing streamed before the answer: its tokens, its end
            assert_eq!(g.messages, 2, "rank {i}");
        }
        // deterministic; n below the width answers the best ranks
        let two = ranks(&mut client, pb::GenerateRequest { n: 2, ..request })
            .await
            .unwrap();
        assert_eq!(two[..], got[..2]);
    }
    assert!(stopped_seen > 0, "a hypothesis ended at its stop token");
    let after = fork_copies(&pool_stats(cluster.cache.addr, GROUP).await.unwrap());
    assert!(after > before, "the beams forked");
    assert_cache_sound(cluster.cache.addr, GROUP, WITHIN)
        .await
        .unwrap();
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beam_width_four_equals_a_reference_beam_search_over_grpc() {
    width_four_equals_the_reference(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beams_are_fed_the_chosen_tokens_in_the_pipelined_order() {
    width_four_equals_the_reference(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_beams_refuse_are_invalid_arguments_naming_them() {
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    };
    let cluster = SmallCluster::start(config).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    let base = pb::GenerateRequest {
        tokens: vec![5, 6, 7, 8],
        max_tokens: 4,
        beam_width: 4,
        ..Default::default()
    };
    let mut bias = HashMap::new();
    bias.insert(5u32, 1.0f32);
    let cases: Vec<(&str, pb::GenerateRequest)> = vec![
        (
            "beam_width",
            pb::GenerateRequest {
                beam_width: 11,
                ..base.clone()
            },
        ),
        (
            "beam_width",
            pb::GenerateRequest {
                beam_width: 1_000,
                ..base.clone()
            },
        ),
        (
            "n",
            pb::GenerateRequest {
                n: 5,
                ..base.clone()
            },
        ),
        (
            "temperature",
            pb::GenerateRequest {
                temperature: 0.7,
                ..base.clone()
            },
        ),
        (
            "top_p",
            pb::GenerateRequest {
                top_p: 0.5,
                ..base.clone()
            },
        ),
        (
            "top_k",
            pb::GenerateRequest {
                top_k: 3,
                ..base.clone()
            },
        ),
        (
            "min_p",
            pb::GenerateRequest {
                min_p: 0.1,
                ..base.clone()
            },
        ),
        (
            "frequency_penalty",
            pb::GenerateRequest {
                frequency_penalty: 0.5,
                ..base.clone()
            },
        ),
        (
            "presence_penalty",
            pb::GenerateRequest {
                presence_penalty: 0.5,
                ..base.clone()
            },
        ),
        (
            "repetition_penalty",
            pb::GenerateRequest {
                repetition_penalty: 1.2,
                ..base.clone()
            },
        ),
        (
            "logit_bias",
            pb::GenerateRequest {
                logit_bias: bias,
                ..base.clone()
            },
        ),
        (
            "min_tokens",
            pb::GenerateRequest {
                min_tokens: 2,
                ..base.clone()
            },
        ),
        (
            "stop",
            pb::GenerateRequest {
                stop: vec!["x".into()],
                ..base.clone()
            },
        ),
        (
            "logprobs",
            pb::GenerateRequest {
                logprobs: Some(pb::LogprobsRequest {
                    top: 2,
                    prompt: false,
                }),
                ..base.clone()
            },
        ),
        (
            "grammar",
            pb::GenerateRequest {
                grammar: Some(pb::Grammar {
                    kind: Some(pb::grammar::Kind::JsonObject(true)),
                }),
                ..base.clone()
            },
        ),
    ];
    for (field, bad) in cases {
        let status = ranks(&mut client, bad).await.unwrap_err();
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{field}: {status:?}"
        );
        assert_eq!(invalid_field(&status), Some(field), "{status:?}");
    }
    // the same fields at their off values are served
    let ok = ranks(
        &mut client,
        pb::GenerateRequest {
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 3,
            ..base.clone()
        },
    )
    .await
    .unwrap();
    assert_eq!(ok.len(), 1);
    // beam width 1 is off: an ordinary request, streamed
    let one = ranks(
        &mut client,
        pb::GenerateRequest {
            beam_width: 1,
            ignore_eos: true,
            ..base
        },
    )
    .await
    .unwrap();
    assert_eq!((one.len(), one[0].tokens.len()), (1, 4));
    assert_eq!(one[0].cumulative_logprob, None);
    cluster.stop().await.unwrap();
}

/// Beam requests of width 4 far past the pool, preempting or rejecting
/// what cannot grow: every rank ends (a hypothesis, or `REJECTED` with the
/// cache's figures), the pools are whole and the audit reclaims nothing.
async fn over_subscribed(on_exhausted: OnExhausted, policy: Policy) -> (usize, usize) {
    const MAX_TOKENS: u32 = 40;
    let config = scheduler_svc::Config {
        policy,
        ..over_subscribed_config(on_exhausted)
    };
    let cluster = SmallCluster::start(config).await.unwrap();
    let pools = pool_stats(cluster.cache.addr, GROUP).await.unwrap();
    let total = pools.iter().find(|p| p.window == 0).map_or(0, |p| p.total);
    let requests = total.max(8) as usize;
    let mut client = cluster.client().await.unwrap();
    let request = |i: usize| pb::GenerateRequest {
        tokens: (0..20)
            .map(|t| ((i * 31 + t * 13) % 250 + 1) as u32)
            .collect(),
        max_tokens: MAX_TOKENS,
        beam_width: 4,
        n: 2,
        ignore_eos: true,
        ..Default::default()
    };
    let mut tasks = Vec::new();
    for i in 0..requests {
        let mut c = client.clone();
        let r = request(i);
        tasks.push(tokio::spawn(async move { ranks(&mut c, r).await }));
    }
    let (mut served, mut refused) = (0, 0);
    let mut answers = Vec::new();
    for t in tasks {
        let got = tokio::time::timeout(Duration::from_secs(180), t)
            .await
            .expect("every request ends in bounded time")
            .expect("task")
            .expect("no request fails at the gRPC level");
        assert_eq!(got.len(), 2, "{got:?}");
        for r in &got {
            match pb::FinishReason::try_from(r.finish) {
                Ok(pb::FinishReason::Length) => {
                    assert_eq!(r.tokens.len(), MAX_TOKENS as usize);
                    assert!(r.cumulative_logprob.is_some());
                    served += 1;
                }
                Ok(pb::FinishReason::Rejected) => refused += 1,
                other => panic!("a rank ended {other:?}: {r:?}"),
            }
        }
        answers.push(got);
    }
    if policy == Policy::GuaranteedNoEvict {
        // every beam's blocks were reserved: no beam was dropped, so each
        // answer is the one the request gets alone
        for (i, got) in answers.iter().enumerate().take(6) {
            let alone = ranks(&mut client, request(i)).await.unwrap();
            assert_eq!(&alone, got, "request {i} under pressure");
        }
    }
    let pools = pool_stats(cluster.cache.addr, GROUP).await.unwrap();
    println!(
        "{requests} beam requests of width 4 on {total} blocks: {served} ranks served, {refused} refused; \
         forks copied {}",
        fork_copies(&pools)
    );
    assert!(fork_copies(&pools) > 0, "beams forked: {pools:?}");
    assert!(served > 0, "ranks were served");
    assert_cache_sound(cluster.cache.addr, GROUP, WITHIN)
        .await
        .unwrap();
    cluster.stop().await.unwrap();
    (served, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_subscribed_beam_run_preempting_leaves_the_pools_whole() {
    over_subscribed(OnExhausted::Preempt, Policy::MaxUtilization).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_subscribed_beam_run_rejecting_leaves_the_pools_whole() {
    over_subscribed(OnExhausted::Reject, Policy::MaxUtilization).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_subscribed_beam_run_reserving_every_beam_leaves_the_pools_whole() {
    let (_, refused) = over_subscribed(OnExhausted::Reject, Policy::GuaranteedNoEvict).await;
    assert_eq!(
        refused, 0,
        "an admitted search reserved every beam's blocks"
    );
}
