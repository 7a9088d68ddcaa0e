//! Log-probabilities over real gRPC (cache, CPU f32 worker, scheduler on
//! loopback ports): every generated token's logprob, and with
//! `logprobs.prompt` every prompt token's (the prompt computed in chunks of
//! 8, so a chunk's last row chooses the next chunk's first token), equal a
//! log-softmax computed here from the worker's dense reference model within
//! 1e-3; the top alternatives are sorted, their probabilities sum to at most
//! 1, and a greedy token is the first of them; a logit bias does not change
//! them (they are of the raw distribution), nor does a grammar's mask (a
//! constrained request's logprobs, prompt's included, are the reference's
//! raw ones while its output follows the grammar); the prompt's logprobs
//! reuse no cached prefix, so a second run gets them all again;
//! out-of-range fields are INVALID_ARGUMENT naming the field; the pools end
//! whole.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease::cluster::Service;
use kvlease_integration_tests::{
    GROUP, invalid_field, scheduler_client, small_worker, start_cache, start_scheduler,
    start_worker, wait_whole,
};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::grammar::Kind;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use tonic::transport::Channel;
use worker_svc::model::weights::Weights;
use worker_svc::reference::DenseModel;

const WITHIN: Duration = Duration::from_secs(60);

/// What one request streamed: tokens, their text and logprobs, the
/// prompt's, how it ended.
#[derive(Debug, Default)]
struct Streamed {
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<pb::TokenLogprob>,
    prompt_logprobs: Vec<pb::TokenLogprob>,
    prompt_text: String,
    reused_tokens: u32,
    finish: i32,
}

async fn stream(client: &mut SchedulerClient<Channel>, r: pb::GenerateRequest) -> Streamed {
    let mut s = client.generate(r).await.unwrap().into_inner();
    let mut out = Streamed::default();
    let mut first = true;
    while let Some(m) = s.message().await.unwrap() {
        if first {
            out.reused_tokens = m.reused_tokens;
            out.prompt_text = m.prompt_text.clone();
            first = false;
        } else {
            assert!(m.prompt_logprobs.is_empty() && m.prompt_text.is_empty());
        }
        assert_eq!(m.logprobs.len(), m.tokens.len(), "one logprob per token");
        if m.finish_reason != 0 {
            assert!(
                [pb::FinishReason::Length, pb::FinishReason::Stop]
                    .map(|f| f as i32)
                    .contains(&m.finish_reason),
                "{}",
                m.message
            );
            out.finish = m.finish_reason;
        }
        out.tokens.extend(&m.tokens);
        out.text.push_str(&m.text);
        out.logprobs.extend(m.logprobs);
        out.prompt_logprobs.extend(m.prompt_logprobs);
    }
    out
}

/// log_softmax of `row` at `token`, in f64, written here from the
/// definition (not the worker's code).
fn reference_logprob(row: &[f32], token: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
    row[token as usize] as f64 - max - sum.ln()
}

/// The alternatives are sorted, at most a distribution, `top` of them.
fn check_top(l: &pb::TokenLogprob, top: usize) {
    assert_eq!(l.top.len(), top, "{l:?}");
    assert!(
        l.top.windows(2).all(|w| w[0].logprob >= w[1].logprob),
        "{l:?}"
    );
    let mass: f64 = l.top.iter().map(|t| (t.logprob as f64).exp()).sum();
    assert!(mass <= 1.0 + 1e-6, "{mass}: {l:?}");
}

/// A cache, the small CPU worker (whose weights come back for the
/// reference) and a scheduler computing prompts in chunks of 8.
struct Cluster {
    cache: Service,
    worker: Service,
    scheduler: Service,
    client: SchedulerClient<Channel>,
    weights: Weights,
}

impl Cluster {
    async fn start() -> Cluster {
        let cache = start_cache(cache_svc::Config::default()).await.unwrap();
        let worker_config = small_worker();
        let weights = worker_config.load_weights().unwrap();
        let worker = start_worker(worker_config).await.unwrap();
        let config = scheduler_svc::Config {
            max_context: 256,
            max_tokens: 64,
            prefill_chunk: 8,
            ..scheduler_svc::Config::default()
        };
        let scheduler = start_scheduler(config, &cache.url(), &[worker.url()], WITHIN)
            .await
            .unwrap();
        let client = scheduler_client(scheduler.addr).await.unwrap();
        Cluster {
            cache,
            worker,
            scheduler,
            client,
            weights,
        }
    }

    /// Checks that the pools are whole, then stops everything.
    async fn stop(self) {
        let pools = wait_whole(self.cache.addr, GROUP, WITHIN).await.unwrap();
        for p in &pools {
            assert_eq!((p.in_use, p.fenced), (0, 0), "{p:?}");
        }
        self.scheduler.stop().await.unwrap();
        self.worker.stop().await.unwrap();
        self.cache.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_equal_the_reference_models_over_grpc() {
    let cluster = Cluster::start().await;
    let (weights, mut client) = (&cluster.weights, cluster.client.clone());

    let prompt: Vec<u32> = (0..21).map(|i| (i * 7 + 3) % 250 + 1).collect();
    let request = pb::GenerateRequest {
        tokens: prompt.clone(),
        max_tokens: 12,
        ignore_eos: true,
        logprobs: Some(pb::LogprobsRequest {
            top: 5,
            prompt: true,
        }),
        echo: true,
        ..Default::default()
    };
    let got = stream(&mut client, request.clone()).await;
    assert_eq!(got.tokens.len(), 12);
    assert_eq!(got.finish, pb::FinishReason::Length as i32);

    // the reference: logits after every position of prompt + output
    let model = DenseModel::new(weights);
    let mut seq = model.sequence();
    let all: Vec<u32> = prompt.iter().chain(&got.tokens).copied().collect();
    let rows = model.forward(&mut seq, &all[..all.len() - 1]);

    // the prompt: its first token has none, token j the row before it
    assert_eq!(got.prompt_logprobs.len(), prompt.len());
    assert_eq!(got.prompt_logprobs[0].logprob, None);
    assert_eq!(got.prompt_logprobs[0].token, prompt[0]);
    assert_eq!(got.prompt_logprobs[0].bytes, [prompt[0] as u8]);
    for (j, l) in got.prompt_logprobs.iter().enumerate().skip(1) {
        assert_eq!(l.token, prompt[j]);
        let want = reference_logprob(&rows[j - 1], prompt[j]);
        let have = f64::from(l.logprob.unwrap());
        assert!(
            (have - want).abs() < 1e-3,
            "prompt token {j}: {have} vs {want}"
        );
        check_top(l, 5);
    }
    // each generated token: greedy, so the most likely, first among the top
    for (k, l) in got.logprobs.iter().enumerate() {
        let row = &rows[prompt.len() - 1 + k];
        assert_eq!(l.token, got.tokens[k]);
        let want = reference_logprob(row, l.token);
        let have = f64::from(l.logprob.unwrap());
        assert!((have - want).abs() < 1e-3, "output {k}: {have} vs {want}");
        check_top(l, 5);
        assert_eq!(l.top[0].token, l.token, "greedy: the chosen token leads");
        assert_eq!(l.top[0].logprob, l.logprob.unwrap());
        for t in &l.top {
            let want = reference_logprob(row, t.token);
            assert!((f64::from(t.logprob) - want).abs() < 1e-3);
            if t.token < 256 {
                assert_eq!(t.bytes, [t.token as u8], "a byte token is its byte");
            }
        }
    }
    // echo: the prompt's text (the byte-level tokenizer's bytes)
    let text: Vec<u8> = prompt.iter().map(|&t| t as u8).collect();
    assert_eq!(got.prompt_text, String::from_utf8_lossy(&text));

    // again: no cached prefix is reused, so every prompt logprob comes back
    let again = stream(&mut client, request.clone()).await;
    assert_eq!(again.reused_tokens, 0);
    assert_eq!(again.tokens, got.tokens);
    assert_eq!(again.prompt_logprobs, got.prompt_logprobs);
    assert_eq!(again.logprobs, got.logprobs);

    // a logit bias changes the pick, not the logprobs: of the raw
    // distribution, the banned greedy token keeps its logprob among the top
    let banned = got.tokens[0];
    let biased = stream(
        &mut client,
        pb::GenerateRequest {
            logit_bias: [(banned, -100.0)].into(),
            max_tokens: 1,
            logprobs: Some(pb::LogprobsRequest {
                top: 3,
                prompt: false,
            }),
            echo: false,
            ..request.clone()
        },
    )
    .await;
    assert!(biased.prompt_logprobs.is_empty() && biased.prompt_text.is_empty());
    let l = &biased.logprobs[0];
    assert_ne!(l.token, banned);
    assert_eq!(l.top[0].token, banned);
    assert_eq!(l.top[0].logprob, got.logprobs[0].logprob.unwrap());
    let want = reference_logprob(&rows[prompt.len() - 1], l.token);
    assert!((f64::from(l.logprob.unwrap()) - want).abs() < 1e-3);

    // sampled with alternatives: the chosen token's logprob is its raw one
    let hot = stream(
        &mut client,
        pb::GenerateRequest {
            temperature: 1.5,
            seed: 7,
            logprobs: Some(pb::LogprobsRequest {
                top: 20,
                prompt: false,
            }),
            echo: false,
            ..request.clone()
        },
    )
    .await;
    let mut seq = model.sequence();
    let hot_all: Vec<u32> = prompt.iter().chain(&hot.tokens).copied().collect();
    let hot_rows = model.forward(&mut seq, &hot_all[..hot_all.len() - 1]);
    for (k, l) in hot.logprobs.iter().enumerate() {
        let want = reference_logprob(&hot_rows[prompt.len() - 1 + k], l.token);
        assert!((f64::from(l.logprob.unwrap()) - want).abs() < 1e-3);
        check_top(l, 20);
    }

    // malformed: named
    for (r, field) in [
        (
            pb::GenerateRequest {
                logprobs: Some(pb::LogprobsRequest {
                    top: 21,
                    prompt: false,
                }),
                ..request.clone()
            },
            "logprobs.top",
        ),
        (
            pb::GenerateRequest {
                retain: Some(pb::RetainPrefix {
                    tokens: 16,
                    priority: 50,
                    ttl_s: 60,
                }),
                ..request.clone()
            },
            "retain",
        ),
    ] {
        let status = match client.generate(r).await {
            Ok(_) => panic!("{field}: accepted"),
            Err(s) => s,
        };
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert_eq!(invalid_field(&status), Some(field), "{status:?}");
    }

    cluster.stop().await;
}

/// Whether `text` is `(yes|no), [0-9]{2,4}!`, checked by hand.
fn follows_the_regex(text: &str) -> bool {
    let Some((word, rest)) = text.split_once(", ") else {
        return false;
    };
    let digits = rest.strip_suffix('!').unwrap_or("");
    ["yes", "no"].contains(&word)
        && (2..=4).contains(&digits.len())
        && digits.bytes().all(|b| b.is_ascii_digit())
}

/// Structured output with logprobs: the grammar's mask picks the tokens,
/// the logprobs stay those of the raw distribution (the logits before the
/// mask), so they equal the dense reference's log-softmax within 1e-3 and
/// list the tokens the grammar refuses among the alternatives. A greedy
/// regex (the next tokens' logprobs) and a sampled JSON schema (the
/// prompt's too, in chunks of 8); both end STOP on the end token with an
/// output that follows the grammar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_with_a_grammar_are_of_the_raw_distribution() {
    let cluster = Cluster::start().await;
    let mut client = cluster.client.clone();
    let model = DenseModel::new(&cluster.weights);
    let prompt: Vec<u32> = b"Answer in the format asked: "
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    let schema = r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": false}"#;
    let regex = pb::GenerateRequest {
        tokens: prompt.clone(),
        max_tokens: 40,
        logprobs: Some(pb::LogprobsRequest {
            top: 5,
            prompt: false,
        }),
        grammar: Some(pb::Grammar {
            kind: Some(Kind::Regex("(yes|no), [0-9]{2,4}!".into())),
        }),
        ..Default::default()
    };
    let json = pb::GenerateRequest {
        temperature: 0.9,
        seed: 11,
        logprobs: Some(pb::LogprobsRequest {
            top: 20,
            prompt: true,
        }),
        grammar: Some(pb::Grammar {
            kind: Some(Kind::JsonSchema(schema.into())),
        }),
        ..regex.clone()
    };
    let mut refused_listed = 0;
    for (name, request) in [("regex", regex), ("json schema", json)] {
        let got = stream(&mut client, request.clone()).await;
        assert_eq!(got.finish, pb::FinishReason::Stop as i32, "{name}: {got:?}");
        assert_eq!(
            got.tokens.last(),
            Some(&257),
            "{name}: ends on the end token"
        );
        let text = &got.text;
        if name == "regex" {
            assert!(follows_the_regex(text), "{name}: {text:?}");
        } else {
            let v: serde_json::Value = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("{name}: {text:?} does not parse: {e}"));
            let n = v["n"].as_i64().unwrap_or(-1);
            assert!(
                (0..=99).contains(&n)
                    && v["ok"].is_boolean()
                    && v.as_object().is_some_and(|o| o.len() == 2),
                "{name}: {text:?} breaks the schema"
            );
        }

        let mut seq = model.sequence();
        let all: Vec<u32> = prompt.iter().chain(&got.tokens).copied().collect();
        let rows = model.forward(&mut seq, &all[..all.len() - 1]);
        if request.logprobs.is_some_and(|l| l.prompt) {
            assert_eq!(got.prompt_logprobs.len(), prompt.len(), "{name}");
            assert_eq!(got.prompt_logprobs[0].logprob, None);
        } else {
            assert!(got.prompt_logprobs.is_empty(), "{name}");
        }
        let top = request.logprobs.map_or(0, |l| l.top) as usize;
        // (the logprob, the row it is of) for every prompt token after the
        // first, then every output token
        let entries = got
            .prompt_logprobs
            .iter()
            .skip(1)
            .enumerate()
            .map(|(j, l)| (l, j))
            .chain(
                got.logprobs
                    .iter()
                    .enumerate()
                    .map(|(k, l)| (l, prompt.len() - 1 + k)),
            );
        let mut not_the_argmax = 0;
        for (l, r) in entries {
            let want = reference_logprob(&rows[r], l.token);
            let have = f64::from(l.logprob.unwrap());
            assert!(
                (have - want).abs() < 1e-3,
                "{name}, row {r}, token {}: {have} vs the raw {want}",
                l.token
            );
            check_top(l, top);
            for t in &l.top {
                let want = reference_logprob(&rows[r], t.token);
                assert!(
                    (f64::from(t.logprob) - want).abs() < 1e-3,
                    "{name}, row {r}"
                );
            }
            if r + 1 >= prompt.len() && l.top.first().is_some_and(|t| t.token != l.token) {
                not_the_argmax += 1;
            }
        }
        // the seeded model does not write JSON or yes/no on its own: picks
        // under the mask left the raw argmax, which stays listed first
        assert!(
            not_the_argmax > 0,
            "{name}: every pick was the raw argmax: {text:?}"
        );
        refused_listed += not_the_argmax;
    }
    println!("{refused_listed} picks under a mask had a likelier raw token listed first");
    cluster.stop().await;
}
