//! The worker over gRPC on 127.0.0.1:0: Describe, a happy-path Forward, each
//! validation case, and proof that a rejected batch writes nothing.

use kvlease_proto::v1 as pb;
use pb::worker_service_client::WorkerServiceClient;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::transport::Channel;
use worker_svc::Config;
use worker_svc::model::tokenizer;

struct Server {
    client: WorkerServiceClient<Channel>,
    stop: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<Result<(), worker_svc::Error>>>,
}

impl Server {
    async fn start(config: Config) -> Server {
        let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
            Ok(l) => l,
            Err(e) => panic!("bind: {e}"),
        };
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => panic!("local_addr: {e}"),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let handle = tokio::spawn(worker_svc::run(listener, config, async {
            let _ = stopped.await;
        }));
        let client = match WorkerServiceClient::connect(format!("http://{addr}")).await {
            Ok(c) => c,
            Err(e) => panic!("connect: {e}"),
        };
        Server {
            client,
            stop: Some(stop),
            handle: Some(handle),
        }
    }

    async fn forward(
        &mut self,
        sequences: Vec<pb::ForwardSequence>,
    ) -> Result<pb::ForwardResponse, tonic::Status> {
        self.client
            .forward(pb::ForwardRequest {
                after_step: 0,
                tier_copies: Vec::new(),
                step: 1,
                sequences,
            })
            .await
            .map(tonic::Response::into_inner)
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(handle) = self.handle.take() {
            match handle.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("server failed: {e}"),
                Err(e) => panic!("server task: {e}"),
            }
        }
    }
}

/// Tables for the default model's two pools (full attention, window 64).
fn tables(full: &[u32], windowed: &[u32]) -> Vec<pb::BlockTable> {
    vec![
        pb::BlockTable {
            pool_id: 1,
            window: 0,
            beam: 0,
            first_block: 0,
            block_ids: full.to_vec(),
        },
        pb::BlockTable {
            pool_id: 2,
            window: 64,
            beam: 0,
            first_block: 0,
            block_ids: windowed.to_vec(),
        },
    ]
}

fn seq(
    seq_id: u64,
    tokens: Vec<u32>,
    start_pos: u32,
    tables: Vec<pb::BlockTable>,
) -> pb::ForwardSequence {
    pb::ForwardSequence {
        seq_id,
        tokens,
        start_pos,
        tables,
        return_all_argmax: true,
        sampling: None,
        copies: Vec::new(),
        history: None,
        grammar: None,
        trace: None,
        feed_previous: false,
        logprobs: None,
        peer_pull: None,
    }
}

fn prompt() -> Vec<u32> {
    tokenizer::encode("the quick brown fox", true)
}

/// Asserts an INVALID_ARGUMENT whose message contains every `needle`.
fn assert_invalid(result: Result<pb::ForwardResponse, tonic::Status>, needles: &[&str]) {
    match result {
        Ok(r) => panic!("expected INVALID_ARGUMENT, got {r:?}"),
        Err(status) => {
            assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
            for needle in needles {
                assert!(
                    status.message().contains(needle),
                    "{:?} lacks {needle:?}",
                    status.message()
                );
            }
        }
    }
}

#[tokio::test]
async fn describe_reports_model_pools_and_budget() {
    let mut server = Server::start(Config::default()).await;
    let d = match server.client.describe(pb::DescribeRequest {}).await {
        Ok(r) => r.into_inner(),
        Err(e) => panic!("describe: {e}"),
    };
    let model = d.model.clone().unwrap_or_default();
    assert_eq!(model.name, "seeded-0");
    assert_eq!(model.vocab_size, 258);
    assert_eq!(
        (model.hidden_size, model.num_layers, model.num_heads),
        (256, 4, 8)
    );
    assert_eq!(
        (model.num_kv_heads, model.head_dim, model.ffn_size),
        (2, 32, 768)
    );
    assert_eq!(model.layer_windows, vec![0, 64, 0, 64]);
    assert_eq!(model.max_context, 2048);
    assert_eq!(d.tokens_per_block, 16);
    assert_eq!((d.backend.as_str(), d.kv_dtype.as_str()), ("cpu", "f32"));
    assert_eq!(d.memory_budget_bytes, 64 << 20);
    assert!(d.weight_bytes > 0 && d.activation_bytes > 0 && !d.device.is_empty());
    assert_eq!((d.max_batch_sequences, d.max_batch_tokens), (64, 1024));
    let windows: Vec<u32> = d.pools.iter().map(|p| p.window).collect();
    assert_eq!(windows, vec![0, 64]);
    let kv_bytes: u64 = d
        .pools
        .iter()
        .map(|p| p.bytes_per_block * u64::from(p.num_blocks))
        .sum();
    for pool in &d.pools {
        assert_eq!(pool.num_layers, 2);
        // 2 layers x K,V x 2 kv heads x 16 tokens x 32 dims x 4 bytes.
        assert_eq!(pool.bytes_per_block, 2 * 2 * 2 * 16 * 32 * 4);
        assert!(pool.num_blocks >= 100, "{pool:?}");
    }
    assert!(d.weight_bytes + d.activation_bytes + kv_bytes <= d.memory_budget_bytes);
    server.stop().await;
}

#[tokio::test]
async fn forward_prefill_then_decode() {
    let mut server = Server::start(Config::default()).await;
    let p = prompt();
    let first = match server
        .forward(vec![seq(1, p.clone(), 0, tables(&[3, 9], &[4, 1]))])
        .await
    {
        Ok(r) => r,
        Err(e) => panic!("prefill: {e}"),
    };
    assert_eq!(first.results.len(), 1);
    let r = &first.results[0];
    assert_eq!(r.seq_id, 1);
    assert_eq!(r.argmax.len(), p.len());
    assert_eq!(
        r.argmax.last().copied(),
        Some(r.next_token),
        "greedy token is the last argmax"
    );
    assert!(r.next_token < 258);

    // Decode the sampled token, next to a second sequence's prefill of the
    // same prompt in other blocks: a mixed batch.
    let mut decode = seq(
        1,
        vec![r.next_token],
        p.len() as u32,
        tables(&[3, 9], &[4, 1]),
    );
    decode.return_all_argmax = false;
    let again = seq(2, p.clone(), 0, tables(&[7, 8], &[2, 0]));
    let second = match server.forward(vec![decode, again]).await {
        Ok(r) => r,
        Err(e) => panic!("mixed batch: {e}"),
    };
    assert_eq!(second.results.len(), 2);
    assert_eq!(second.results[0].seq_id, 1);
    assert!(second.results[0].argmax.is_empty());
    assert_eq!(
        second.results[1].argmax, r.argmax,
        "same prompt, same argmax"
    );

    // Seeded sampling reproduces itself.
    let sampled = |id| pb::ForwardSequence {
        sampling: Some(pb::SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: 42,
            ..Default::default()
        }),
        ..seq(
            id,
            p.clone(),
            0,
            tables(
                &[20 + id as u32, 40 + id as u32],
                &[20 + id as u32, 40 + id as u32],
            ),
        )
    };
    let a = server
        .forward(vec![sampled(5)])
        .await
        .map(|r| r.results[0].next_token);
    let b = server
        .forward(vec![sampled(6)])
        .await
        .map(|r| r.results[0].next_token);
    assert!(a.is_ok());
    assert_eq!(a.ok(), b.ok());
    server.stop().await;
}

#[tokio::test]
async fn rejects_block_ids_out_of_range() {
    let mut server = Server::start(Config::default()).await;
    let result = server
        .forward(vec![seq(7, prompt(), 0, tables(&[3, 4_000_000], &[1, 2]))])
        .await;
    assert_invalid(
        result,
        &["sequence 7", "block id 4000000 out of range", "window 0"],
    );
    server.stop().await;
}

#[tokio::test]
async fn rejects_a_block_table_too_short_for_the_positions() {
    let mut server = Server::start(Config::default()).await;
    let tokens: Vec<u32> = (0..20).collect();
    let result = server
        .forward(vec![seq(7, tokens, 0, tables(&[3, 4], &[1]))])
        .await;
    assert_invalid(
        result,
        &[
            "sequence 7",
            "block table too short for window 64",
            "0..=19",
        ],
    );
    server.stop().await;
}

#[tokio::test]
async fn rejects_duplicate_sequence_ids() {
    let mut server = Server::start(Config::default()).await;
    let result = server
        .forward(vec![
            seq(7, prompt(), 0, tables(&[1, 2], &[1, 2])),
            seq(7, prompt(), 0, tables(&[3, 4], &[3, 4])),
        ])
        .await;
    assert_invalid(result, &["sequence 7", "duplicate sequence id"]);
    server.stop().await;
}

#[tokio::test]
async fn rejects_inconsistent_positions() {
    let mut server = Server::start(Config::default()).await;
    // start_pos 32 on blocks nobody wrote: there is no K/V for 0..32.
    let result = server
        .forward(vec![seq(
            7,
            vec![1, 2, 3],
            32,
            tables(&[1, 2, 3], &[1, 2, 3]),
        )])
        .await;
    assert_invalid(
        result,
        &[
            "sequence 7",
            "inconsistent positions",
            "start_pos 32",
            "position 0",
        ],
    );
    // Positions past max_context.
    let blocks: Vec<u32> = (0..128).collect();
    let result = server
        .forward(vec![seq(8, vec![1; 10], 2040, tables(&blocks, &blocks))])
        .await;
    assert_invalid(
        result,
        &["sequence 8", "inconsistent positions", "max_context 2048"],
    );
    // Two sequences writing the same slot.
    let result = server
        .forward(vec![
            seq(9, prompt(), 0, tables(&[1, 2], &[1, 2])),
            seq(10, prompt(), 0, tables(&[1, 3], &[4, 5])),
        ])
        .await;
    assert_invalid(result, &["sequence 10", "slot 0 of block 1", "sequence 9"]);
    server.stop().await;
}

#[tokio::test]
async fn rejects_tables_that_do_not_match_the_pools() {
    let mut server = Server::start(Config::default()).await;
    let mut one = tables(&[1, 2], &[3, 4]);
    one.truncate(1);
    assert_invalid(
        server.forward(vec![seq(7, prompt(), 0, one)]).await,
        &["sequence 7", "no block table for the pool of window 64"],
    );
    // A beam-search lease: a second table per pool, for beam 1.
    let mut beam = tables(&[1, 2], &[3, 4]);
    beam.push(pb::BlockTable {
        beam: 1,
        ..beam[0].clone()
    });
    assert_invalid(
        server.forward(vec![seq(8, prompt(), 0, beam)]).await,
        &["sequence 8", "beam 1"],
    );
    let mut unknown = tables(&[1, 2], &[3, 4]);
    unknown[1].window = 32;
    assert_invalid(
        server.forward(vec![seq(9, prompt(), 0, unknown)]).await,
        &["sequence 9", "window 32"],
    );
    server.stop().await;
}

#[tokio::test]
async fn rejects_batches_over_the_limits() {
    let config = Config {
        max_batch_sequences: 2,
        max_batch_tokens: 32,
        ..Config::default()
    };
    let mut server = Server::start(config).await;
    let three = (0..3)
        .map(|i| seq(i, vec![1, 2], 0, tables(&[i as u32], &[i as u32])))
        .collect();
    assert_invalid(
        server.forward(three).await,
        &["3 sequences", "max_batch_sequences = 2"],
    );
    let tokens: Vec<u32> = (0..20).collect();
    let big = vec![
        seq(1, tokens.clone(), 0, tables(&[1, 2], &[1, 2])),
        seq(2, tokens, 0, tables(&[3, 4], &[3, 4])),
    ];
    assert_invalid(
        server.forward(big).await,
        &["40 tokens", "max_batch_tokens = 32"],
    );
    server.stop().await;
}

#[tokio::test]
async fn a_rejected_forward_leaves_the_arena_untouched() {
    let mut server = Server::start(Config::default()).await;
    let context: Vec<u32> = tokenizer::encode("a sentence of some twenty bytes!", true);
    let n = context.len() as u32;
    let (full, windowed) = ([10, 11, 12], [20, 21, 22]);
    if let Err(e) = server
        .forward(vec![seq(1, context.clone(), 0, tables(&full, &windowed))])
        .await
    {
        panic!("prefill: {e}");
    }
    // A probe that reads the whole context: eight draft-like positions,
    // sampled hot with several seeds so the tokens depend on every logit.
    let probe_tokens: Vec<u32> = (40..48).collect();
    let probe = |seed| pb::ForwardSequence {
        sampling: Some(pb::SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            seed,
            ..Default::default()
        }),
        ..seq(1, probe_tokens.clone(), n, tables(&full, &windowed))
    };
    async fn probe_all(
        server: &mut Server,
        probe: &impl Fn(u64) -> pb::ForwardSequence,
    ) -> Vec<pb::ForwardResult> {
        let mut results = Vec::new();
        for seed in 0..4 {
            match server.forward(vec![probe(seed)]).await {
                Ok(r) => results.extend(r.results),
                Err(e) => panic!("probe: {e}"),
            }
        }
        results
    }
    let before = probe_all(&mut server, &probe).await;

    // Overwrites the context's first block, next to an invalid sequence.
    let clobber = || {
        seq(
            2,
            (100..116).collect(),
            0,
            tables(&full[..1], &windowed[..1]),
        )
    };
    let invalid = seq(3, prompt(), 0, tables(&[999_999], &[5]));
    assert_invalid(
        server.forward(vec![clobber(), invalid]).await,
        &["sequence 3", "out of range"],
    );
    let after = probe_all(&mut server, &probe).await;
    assert_eq!(after, before, "the rejected batch wrote nothing");

    // The same overwrite, accepted, does change what the probe sees: the
    // check above could have failed.
    if let Err(e) = server.forward(vec![clobber()]).await {
        panic!("clobber: {e}");
    }
    let clobbered = probe_all(&mut server, &probe).await;
    assert_ne!(
        clobbered, before,
        "an accepted overwrite is visible to the probe"
    );
    server.stop().await;
}

/// Sequence 2 shares block 0 with sequence 1 (blocks 3 and 4 of the two
/// pools), starts at `start_pos` in its own block 1 (11 and 13) and brings
/// `copies`.
fn copying(copies: Vec<pb::BlockCopy>, start_pos: u32) -> pb::ForwardSequence {
    let mut s = seq(2, vec![5, 6], start_pos, tables(&[3, 11], &[4, 13]));
    s.copies = copies;
    s
}

fn copy(window: u32, src: u32, dst: u32, tokens: u32) -> pb::BlockCopy {
    pb::BlockCopy {
        pool_id: 0,
        window,
        src_block: src,
        dst_block: dst,
        tokens,
    }
}

#[tokio::test]
async fn partial_block_copies_are_validated_and_applied() {
    let mut server = Server::start(Config::default()).await;
    // Sequence 1 writes positions 0..20: blocks 3 (slots 0..16) and 9 (0..4)
    // in the full pool, 4 and 1 in the windowed one.
    let p: Vec<u32> = (1..=20).collect();
    let first = server
        .forward(vec![seq(1, p.clone(), 0, tables(&[3, 9], &[4, 1]))])
        .await;
    assert!(first.is_ok(), "{first:?}");
    // Sequence 2 reuses block 0 and copies slots 0..4 of block 9 (and 1)
    // into its block 11 (and 13) instead of computing positions 16..20.
    let good = || vec![copy(0, 9, 11, 4), copy(64, 1, 13, 4)];
    let cases: Vec<(pb::ForwardSequence, &[&str])> = vec![
        (copying(vec![copy(0, 9, 11, 16)], 20), &["1 to 15"]),
        (copying(vec![copy(0, 11, 11, 4)], 20), &["same block"]),
        (copying(vec![copy(0, 9, 100_000, 4)], 20), &["out of range"]),
        (copying(vec![copy(7, 9, 11, 4)], 20), &["window 7"]),
        (
            copying(vec![copy(0, 9, 11, 3)], 20),
            &["start_pos 20 is 4 slots"],
        ),
        (
            copying(vec![copy(0, 9, 10, 4)], 20),
            &["not the sequence's block 1"],
        ),
        (
            copying(vec![copy(0, 3, 11, 4)], 20),
            &["one of the sequence's own"],
        ),
        (
            copying(vec![copy(0, 9, 11, 4), copy(0, 8, 11, 4)], 20),
            &["two copies"],
        ),
        (
            copying(vec![copy(0, 5, 11, 4)], 20),
            &["do not all hold K/V"],
        ),
    ];
    for (bad, needles) in cases {
        let mut needles = needles.to_vec();
        needles.push("partial-block copy");
        assert_invalid(server.forward(vec![bad]).await, &needles);
    }
    // A copy whose source slots another sequence of the batch writes.
    let restart = seq(3, vec![7, 8], 16, tables(&[3, 9], &[4, 1]));
    assert_invalid(
        server.forward(vec![restart, copying(good(), 20)]).await,
        &["slots 0..4 of source block 9 are written by this batch"],
    );
    // Nothing above wrote anything: the good copy still finds its sources
    // and the destination's slots count as written for the pass, while the
    // source's owner writes its next slot (a fork's parent decoding into
    // the block its branch copies from: the copies run first).
    let parent = seq(1, vec![7], 20, tables(&[3, 9], &[4, 1]));
    let ok = server.forward(vec![parent, copying(good(), 20)]).await;
    assert!(ok.is_ok(), "{ok:?}");
    server.stop().await;
}

#[tokio::test]
async fn malformed_sampling_and_a_missing_history_are_refused_before_anything_runs() {
    let mut server = Server::start(Config::default()).await;
    let penalised = |history: Option<Vec<u32>>, start_pos: u32| pb::ForwardSequence {
        sampling: Some(pb::SamplingParams {
            frequency_penalty: 0.5,
            ..Default::default()
        }),
        history: history.map(|tokens| pb::TokenHistory { tokens }),
        return_all_argmax: false,
        ..seq(3, vec![1, 2], start_pos, tables(&[3], &[4]))
    };
    let biased = pb::ForwardSequence {
        sampling: Some(pb::SamplingParams {
            logit_bias: [(5, -250.0)].into(),
            ..Default::default()
        }),
        ..seq(3, vec![1, 2], 0, tables(&[3], &[4]))
    };
    assert_invalid(
        server.forward(vec![biased]).await,
        &["sequence 3", "logit_bias"],
    );
    assert_invalid(
        server.forward(vec![penalised(Some(vec![7]), 0)]).await,
        &["sequence 3", "history holds 1 tokens but start_pos is 0"],
    );
    // penalties without the tokens before: FAILED_PRECONDITION
    match server.forward(vec![penalised(None, 0)]).await {
        Ok(r) => panic!("expected FAILED_PRECONDITION, got {r:?}"),
        Err(status) => {
            assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
            assert!(status.message().contains("sequence 3"), "{status:?}");
        }
    }
    // with its history it runs, and the next pass needs none
    let first = server.forward(vec![penalised(Some(Vec::new()), 0)]).await;
    assert!(first.is_ok(), "{first:?}");
    let next = server.forward(vec![penalised(None, 2)]).await;
    assert!(next.is_ok(), "{next:?}");
    server.stop().await;
}

#[tokio::test]
async fn logprobs_come_back_per_position_and_malformed_ones_are_refused() {
    let mut server = Server::start(Config::default()).await;
    let asking = |logprobs: pb::LogprobsParams| pb::ForwardSequence {
        logprobs: Some(logprobs),
        return_all_argmax: false,
        ..seq(3, vec![1, 2, 3], 0, tables(&[3], &[4]))
    };
    for (params, needle) in [
        (
            pb::LogprobsParams {
                top: 21,
                ..Default::default()
            },
            "top 21 is more than 20",
        ),
        (
            pb::LogprobsParams {
                next_prompt_token: Some(4),
                ..Default::default()
            },
            "next_prompt_token is set without prompt",
        ),
        (
            pb::LogprobsParams {
                prompt: true,
                next_prompt_token: Some(1 << 20),
                ..Default::default()
            },
            "outside the vocabulary",
        ),
    ] {
        assert_invalid(
            server.forward(vec![asking(params)]).await,
            &["sequence 3", "logprobs", needle],
        );
    }
    // the prompt's every position: tokens[i + 1] chosen, then the next chunk's
    let prompt = pb::LogprobsParams {
        top: 4,
        prompt: true,
        next_prompt_token: Some(9),
    };
    let r = match server.forward(vec![asking(prompt)]).await {
        Ok(r) => r,
        Err(status) => panic!("forward: {status:?}"),
    };
    let lp = &r.results[0].logprobs;
    let chosen: Vec<u32> = lp.iter().map(|p| p.token).collect();
    assert_eq!(chosen, [2, 3, 9]);
    for p in lp {
        assert_eq!(p.top_tokens.len(), 4);
        assert_eq!(p.top_logprobs.len(), 4);
        assert!(p.top_logprobs.windows(2).all(|w| w[0] >= w[1]));
        let mass: f32 = p.top_logprobs.iter().map(|l| l.exp()).sum();
        assert!(mass <= 1.0 + 1e-6 && p.logprob <= 0.0, "{p:?}");
    }
    assert!(r.results[0].argmax.is_empty(), "logprobs ask no argmax");
    // the next token's only: the picked one, the greedy choice top first
    let next = pb::LogprobsParams {
        top: 2,
        ..Default::default()
    };
    let decode = pb::ForwardSequence {
        start_pos: 3,
        tokens: vec![5],
        ..asking(next)
    };
    let r = match server.forward(vec![decode]).await {
        Ok(r) => r,
        Err(status) => panic!("forward: {status:?}"),
    };
    let lp = &r.results[0].logprobs;
    assert_eq!(lp.len(), 1);
    assert_eq!(lp[0].token, r.results[0].next_token);
    assert_eq!(lp[0].top_tokens[0], r.results[0].next_token);
    assert_eq!(lp[0].logprob, lp[0].top_logprobs[0]);
    server.stop().await;
}

#[tokio::test]
async fn a_constrained_sequence_picks_only_what_its_grammar_allows() {
    let mut server = Server::start(Config::default()).await;
    let regex = |rx: &str| pb::Grammar {
        kind: Some(pb::grammar::Kind::Regex(rx.into())),
    };
    // the seeded model's byte tokens: the output must be "7", then "x" or
    // "y", then its end token (257)
    let constrained =
        |tokens: Vec<u32>, start_pos: u32, grammar: Option<pb::Grammar>| pb::ForwardSequence {
            sampling: Some(pb::SamplingParams {
                constrained: true,
                prompt_len: 2,
                ..Default::default()
            }),
            history: grammar.as_ref().map(|_| pb::TokenHistory {
                tokens: vec![0; start_pos as usize],
            }),
            grammar,
            return_all_argmax: false,
            ..seq(3, tokens, start_pos, tables(&[3], &[4]))
        };
    // malformed: a grammar of no kind, one that does not compile, one
    // without its history, one on an unconstrained sequence
    let mut no_kind = constrained(vec![1, 2], 0, Some(pb::Grammar { kind: None }));
    assert_invalid(
        server.forward(vec![no_kind.clone()]).await,
        &["sequence 3", "grammar: no kind set"],
    );
    assert_invalid(
        server
            .forward(vec![constrained(vec![1, 2], 0, Some(regex("(")))])
            .await,
        &["sequence 3", "invalid regex"],
    );
    no_kind.grammar = Some(regex("7"));
    no_kind.history = None;
    assert_invalid(
        server.forward(vec![no_kind]).await,
        &["sequence 3", "without the sequence's history"],
    );
    let mut unconstrained = constrained(vec![1, 2], 0, Some(regex("7")));
    unconstrained.sampling = None;
    assert_invalid(
        server.forward(vec![unconstrained]).await,
        &["sequence 3", "not constrained"],
    );
    // constrained without its matcher on the worker: FAILED_PRECONDITION
    match server.forward(vec![constrained(vec![1, 2], 0, None)]).await {
        Ok(r) => panic!("expected FAILED_PRECONDITION, got {r:?}"),
        Err(status) => {
            assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
            assert!(status.message().contains("sequence 3"), "{status:?}");
        }
    }
    let next = |r: Result<pb::ForwardResponse, tonic::Status>| match r {
        Ok(r) => r.results[0].next_token,
        Err(s) => panic!("{s:?}"),
    };
    let t = next(
        server
            .forward(vec![constrained(vec![1, 2], 0, Some(regex("7[xy]")))])
            .await,
    );
    assert_eq!(t, u32::from(b'7'));
    let t = next(server.forward(vec![constrained(vec![t], 2, None)]).await);
    assert!([b'x', b'y'].map(u32::from).contains(&t), "{t}");
    let t = next(server.forward(vec![constrained(vec![t], 3, None)]).await);
    assert_eq!(t, 257, "complete: the end token");
    server.stop().await;
}

/// Disk-tier copies over gRPC: a worker without a disk tier refuses them
/// naming the copy; with one, a disk block out of range is refused, and a
/// load whose file is missing is `FAILED_PRECONDITION` (a miss), nothing
/// applied; `Describe` reports the tier and the worker's incarnation.
#[tokio::test]
async fn disk_tier_copies_are_validated_and_a_missing_file_is_a_miss() {
    let copy = |direction: pb::tier_copy::Direction, disk_block: u32| pb::TierCopy {
        pool_id: 1,
        window: 0,
        direction: direction as i32,
        device_block: 1,
        host_block: 1,
        disk_block,
        hash: 7,
        parent: 0,
    };
    let request = |copies: Vec<pb::TierCopy>| pb::ForwardRequest {
        step: 1,
        sequences: Vec::new(),
        tier_copies: copies,
        after_step: 0,
    };
    let config = Config {
        host_blocks: 4,
        ..Config::default()
    };
    let mut plain = Server::start(config.clone()).await;
    let result = plain
        .client
        .forward(request(vec![copy(pb::tier_copy::Direction::Load, 0)]))
        .await
        .map(tonic::Response::into_inner);
    assert_invalid(result, &["tier_copies[0]", "no disk tier"]);
    plain.stop().await;

    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir =
        std::env::temp_dir().join(format!("kvlease-grpc-disk-{}-{nanos}", std::process::id()));
    let mut server = Server::start(Config {
        disk_tier_dir: Some(dir.clone()),
        disk_tier_bytes: Some(1 << 22),
        ..config
    })
    .await;
    let d = server
        .client
        .describe(pb::DescribeRequest {})
        .await
        .map(tonic::Response::into_inner)
        .unwrap_or_else(|s| panic!("describe: {s:?}"));
    assert_ne!(d.incarnation, 0);
    let blocks = d.pools[0].disk_blocks;
    assert!(blocks > 0 && d.pools.iter().all(|p| p.disk_held.is_empty()));
    let result = server
        .client
        .forward(request(vec![copy(pb::tier_copy::Direction::Spill, blocks)]))
        .await
        .map(tonic::Response::into_inner);
    assert_invalid(result, &["tier_copies[0]", &format!("disk_block {blocks}")]);
    match server
        .client
        .forward(request(vec![copy(pb::tier_copy::Direction::Load, 3)]))
        .await
    {
        Err(status) => {
            assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
            assert!(status.message().contains("disk block 3"), "{status:?}");
        }
        Ok(r) => panic!("a load of a missing file answered {r:?}"),
    }
    server.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
