//! The model's tokenizer as the one source of truth: the scheduler takes it
//! from the workers (GetTokenizer, above tonic's 4 MiB default), refuses
//! replicas that disagree, and uses it for text, chat messages, end ids and
//! stop strings.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;
use kvlease_tokenizer::{GgufVocab, Tokenizer};

fn config() -> scheduler_svc::Config {
    scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    }
}

/// A byte-level BPE with a chat template whose tokenizer.json is over
/// 4 MiB: 258 tokens, most of them 20 KB long (built once per run).
fn big_tokenizer() -> Tokenizer {
    static BIG: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    BIG.get_or_init(build_big_tokenizer).clone()
}

fn build_big_tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("{b:03}")).collect();
    for (i, t) in tokens.iter_mut().enumerate().skip(2) {
        *t = format!("{i:03}{}", "x".repeat(20_000));
    }
    tokens[0] = "<|end|>".into();
    tokens[1] = "<|start|>".into();
    tokens.push("a".into());
    tokens.push("b".into());
    let mut token_types = vec![1; tokens.len()];
    token_types[0] = 3;
    token_types[1] = 3;
    let vocab = GgufVocab {
        model: "gpt2".into(),
        tokens,
        token_types,
        bos_id: Some(1),
        eos_id: Some(0),
        chat_template: Some(
            "{% for m in messages %}<|start|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}ab{% endif %}".into(),
        ),
        ..Default::default()
    };
    Tokenizer::from_gguf(&vocab).expect("builds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_tokenizer_serves_the_model_tokenizer_and_refuses_malformed_requests() {
    let big = big_tokenizer();
    assert!(
        big.parts().tokenizer_json.len() > 4 << 20,
        "the test needs > 4 MiB"
    );
    let worker = start_worker_with_tokenizer(small_worker(), big.clone())
        .await
        .unwrap();
    let mut c = worker_client(worker.addr).await.unwrap();
    let d = c
        .describe(pb::DescribeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.model.unwrap().tokenizer_fingerprint, big.fingerprint());
    let r = c
        .get_tokenizer(pb::GetTokenizerRequest {
            fingerprint: big.fingerprint().into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.fingerprint, big.fingerprint());
    assert_eq!(r.tokenizer_json, big.parts().tokenizer_json);
    assert_eq!(
        (r.bos_id, r.end_ids, r.kind.as_str()),
        (Some(1), vec![0], "hf")
    );
    let huge = "f".repeat(1 << 20);
    for (fingerprint, code, what) in [
        ("xyz", tonic::Code::InvalidArgument, "is not 16 hex digits"),
        // named back clipped (issue 29, point 9)
        (
            huge.as_str(),
            tonic::Code::InvalidArgument,
            "... (1048576 bytes) is not 16 hex digits",
        ),
        (
            "0123456789abcdeg",
            tonic::Code::InvalidArgument,
            "is not 16 hex digits",
        ),
        (
            "0123456789abcdef",
            tonic::Code::FailedPrecondition,
            "not 0123456789abcdef",
        ),
    ] {
        let e = c
            .get_tokenizer(pb::GetTokenizerRequest {
                fingerprint: fingerprint.into(),
            })
            .await
            .expect_err("refused");
        assert_eq!(e.code(), code, "{fingerprint:.100}: {e:.300}");
        assert!(e.message().contains(what), "{:.300}", e.message());
        assert!(e.message().len() < 1024, "{} bytes", e.message().len());
    }
    worker.stop().await.unwrap();
}

/// A cache and a scheduler over `worker`: (cache, worker, scheduler).
async fn cluster(worker: Service) -> [Service; 3] {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let s = start_scheduler(
        config(),
        &cache.url(),
        &[worker.url()],
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    [cache, worker, s]
}

async fn stop_all(services: [Service; 3]) {
    for s in services.into_iter().rev() {
        s.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduler_uses_the_workers_tokenizer_for_chat_and_end_ids() {
    let big = big_tokenizer();
    let worker = start_worker_with_tokenizer(small_worker(), big.clone())
        .await
        .unwrap();
    let services = cluster(worker).await;
    let mut c = scheduler_client(services[2].addr).await.unwrap();
    // the chat is rendered and encoded by the worker's tokenizer: "<|start|>"
    // is id 1, "a" 256, "b" 257
    let g = collect(
        &mut c,
        pb::GenerateRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "ab".into(),
            }],
            max_tokens: 8,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(g.tokens.len(), 8, "{g:?}");
    assert_eq!(g.text, big.decode(&g.tokens));
    let e = c
        .generate(pb::GenerateRequest {
            messages: vec![pb::ChatMessage::default()],
            max_tokens: 1,
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("message 0 has no role"),
        "{}",
        e.message()
    );
    stop_all(services).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_level_chat_is_refused_and_stop_strings_end_the_text() {
    let services = cluster(start_worker(small_worker()).await.unwrap()).await;
    let mut c = scheduler_client(services[2].addr).await.unwrap();
    let e = c
        .generate(pb::GenerateRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
            }],
            max_tokens: 4,
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(e.message().contains("no chat template"), "{}", e.message());

    // the seeded model's text, then the same request stopped at its third
    // character: the text ends before the stop string
    let ask = |stop: Vec<String>| pb::GenerateRequest {
        text: "hello".into(),
        max_tokens: 24,
        ignore_eos: true,
        stop,
        ..Default::default()
    };
    let full = collect(&mut c, ask(vec![])).await.unwrap();
    assert_eq!(full.finish_reason(), pb::FinishReason::Length);
    let Some((at, ch)) = full.text.char_indices().nth(2) else {
        panic!("the seeded model wrote less than 3 characters: {full:?}");
    };
    let stopped = collect(&mut c, ask(vec![ch.to_string()])).await.unwrap();
    assert_eq!(
        stopped.finish_reason(),
        pb::FinishReason::Stop,
        "{stopped:?}"
    );
    let first = full.text.find(ch).unwrap_or(at);
    assert_eq!(stopped.text, full.text[..first]);
    for (stop, what) in [
        (vec![String::new()], "must be 1 to 256 bytes"),
        (vec!["x".into(); 17], "at most 16"),
    ] {
        let e = c.generate(ask(stop)).await.expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains(what), "{}", e.message());
    }
    stop_all(services).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_different_tokenizers_refuse_to_start_naming_both() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let seeded = start_worker(small_worker()).await.unwrap();
    let big = big_tokenizer();
    let other = start_worker_with_tokenizer(small_worker(), big.clone())
        .await
        .unwrap();
    let e = run_scheduler_start(config(), &cache.url(), &[seeded.url(), other.url()])
        .await
        .expect_err("must not start");
    let m = e.to_string();
    let byte_level = Tokenizer::byte_level();
    for part in [
        "workers disagree on the tokenizer",
        &seeded.url(),
        &other.url(),
        byte_level.fingerprint(),
        big.fingerprint(),
    ] {
        assert!(m.contains(part), "{part:?} not in {m}");
    }
    seeded.stop().await.unwrap();
    other.stop().await.unwrap();
    cache.stop().await.unwrap();
}
