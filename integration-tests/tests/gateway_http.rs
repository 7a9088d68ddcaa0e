//! The HTTP front (`kvlease-gateway`) against a real cluster: cache, a CPU
//! worker and the scheduler in-process on loopback ports, the gateway on `127.0.0.1:0`,
//! and real HTTP/1.1 requests. Each answer is checked against the same
//! request sent over gRPC.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use kvlease_integration_tests::gateway::{Gateway, chatml_tokenizer};
use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;
use kvlease_tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::net::TcpStream;

/// A running cluster with the gateway in front.
struct Front {
    http: SocketAddr,
    scheduler: Service,
    worker: Service,
    cache: Service,
    gateway: Gateway,
}

/// The small worker's pools hold 23 blocks of 16 tokens: a context of 256
/// fits its warm-up.
fn scheduler_config() -> scheduler_svc::Config {
    scheduler_svc::Config {
        max_context: 256,
        max_tokens: 200,
        ..scheduler_svc::Config::default()
    }
}

impl Front {
    async fn start(tokenizer: Option<Tokenizer>) -> Front {
        let cache = start_cache(cache_svc::Config::default()).await.unwrap();
        let worker = match tokenizer {
            Some(t) => start_worker_with_tokenizer(small_worker(), t).await,
            None => start_worker(small_worker()).await,
        }
        .unwrap();
        Self::over(cache, worker, None, scheduler_config()).await
    }

    /// The scheduler (with `config`) and the gateway over `cache` and
    /// `worker`, the scheduler reaching the worker through `via` if given.
    async fn over(
        cache: Service,
        worker: Service,
        via: Option<&Service>,
        config: scheduler_svc::Config,
    ) -> Front {
        let worker_url = via.map_or_else(|| worker.url(), Service::url);
        let scheduler =
            start_scheduler(config, &cache.url(), &[worker_url], Duration::from_secs(60))
                .await
                .unwrap();
        let gateway = Gateway::start(scheduler.url()).await.unwrap();
        Front {
            http: gateway.http,
            scheduler,
            worker,
            cache,
            gateway,
        }
    }

    async fn grpc(&self, request: pb::GenerateRequest) -> Generated {
        let mut c = scheduler_client(self.scheduler.addr).await.unwrap();
        collect(&mut c, request).await.unwrap()
    }

    async fn get(&self, path: &str) -> Reply {
        request(self.http, "GET", path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> Reply {
        request(self.http, "POST", path, Some(body.to_string())).await
    }

    async fn stop(self) {
        self.gateway.stop().await.unwrap();
        self.scheduler.stop().await.unwrap();
        self.worker.stop().await.unwrap();
        self.cache.stop().await.unwrap();
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    content_type: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of an SSE body.
    fn events(&self) -> Vec<String> {
        assert_eq!(self.content_type, "text/event-stream", "{self:?}");
        self.body
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                e.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not a data event: {e:?}"))
                    .to_string()
            })
            .collect()
    }

    /// The JSON events before `[DONE]`, which must be last.
    fn chunks(&self) -> Vec<Value> {
        let mut events = self.events();
        assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{self:?}");
        events
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }
}

/// One HTTP/1.1 request on a fresh connection, read to its end.
async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<String>) -> Reply {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .unwrap();
    let res = sender.send_request(req).await.unwrap();
    let status = res.status().as_u16();
    let content_type = res
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        content_type,
        body: String::from_utf8(body.to_vec()).unwrap(),
    }
}

/// A 40-byte prompt: two full blocks of 16 tokens that a second request reuses.
const PROMPT: &str = "The paged KV cache lends blocks to work.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_whole_and_streamed_match_grpc() {
    let f = Front::start(None).await;
    let health = f.get("/health").await;
    assert_eq!(
        (health.status, health.json()["status"].as_str()),
        (200, Some("ok"))
    );
    let models = f.get("/v1/models").await;
    assert_eq!(models.status, 200, "{models:?}");
    assert_eq!(models.json()["data"][0]["id"], "kvlease");
    assert_eq!(f.get("/v1/models/kvlease").await.status, 200);

    let by_text = pb::GenerateRequest {
        text: PROMPT.into(),
        max_tokens: 6,
        ..Default::default()
    };
    let grpc = f.grpc(by_text.clone()).await;
    assert_eq!(
        grpc.prompt_tokens,
        PROMPT.len() as u32,
        "the byte-level tokenizer: a token a byte"
    );
    let body = json!({"model": "kvlease", "prompt": PROMPT, "max_tokens": 6, "temperature": 0});
    let whole = f.post("/v1/completions", body.clone()).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    let w = whole.json();
    assert_eq!(w["object"], "text_completion");
    assert_eq!(w["choices"][0]["text"].as_str(), Some(grpc.text.as_str()));
    assert_eq!(w["choices"][0]["finish_reason"], "length");
    let usage = &w["usage"];
    assert_eq!(usage["prompt_tokens"], PROMPT.len());
    assert_eq!(usage["completion_tokens"], 6);
    assert_eq!(usage["total_tokens"], PROMPT.len() + 6);
    // the gRPC call before left the prompt's two full blocks cached, and
    // the partly filled third (partial-block reuse): all but the prompt's
    // last token, which is always computed
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        PROMPT.len() - 1,
        "{usage}"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let sse = f.post("/v1/completions", streamed).await;
    assert_eq!(sse.status, 200, "{sse:?}");
    let chunks = sse.chunks();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, grpc.text);
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 6);
    assert_eq!(
        rest.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert!(
        rest.iter()
            .all(|c| c["object"] == "text_completion" && c["id"] == rest[0]["id"])
    );

    // token prompts and a stop string
    let tokens: Vec<u32> = PROMPT.bytes().map(u32::from).collect();
    let t = f
        .post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": tokens, "max_tokens": 6, "temperature": 0}),
        )
        .await;
    assert_eq!(t.status, 200, "{t:?}");
    assert_eq!(t.json()["usage"]["prompt_tokens"], PROMPT.len());
    // a token-id prompt gets its output's text too (issue 25, point 5),
    // over HTTP and gRPC
    assert!(!grpc.text.is_empty(), "{grpc:?}");
    assert_eq!(
        t.json()["choices"][0]["text"].as_str(),
        Some(grpc.text.as_str()),
        "{t:?}"
    );
    let by_ids = f
        .grpc(pb::GenerateRequest {
            text: String::new(),
            tokens: tokens.clone(),
            ..by_text
        })
        .await;
    assert_eq!(
        (by_ids.tokens, by_ids.text),
        (grpc.tokens, grpc.text.clone())
    );
    let first_char: String = grpc.text.chars().take(1).collect();
    if !first_char.is_empty() {
        // a stop string ends the text before it, for a token-id prompt as
        // for a text one
        for prompt in [json!(PROMPT), json!(tokens)] {
            let s = f
                .post(
                    "/v1/completions",
                    json!({"model": "kvlease", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stop": [first_char]}),
                )
                .await;
            assert_eq!(s.status, 200, "{s:?}");
            assert_eq!(s.json()["choices"][0]["finish_reason"], "stop", "{s:?}");
            assert_eq!(
                s.json()["choices"][0]["text"],
                "",
                "the text ends before the stop string: {s:?}"
            );
        }
    }
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_400_in_openai_shape_with_the_schedulers_message() {
    let f = Front::start(None).await;
    let expect = |r: &Reply, status: u16, needle: &str| {
        assert_eq!(r.status, status, "{r:?}");
        assert_eq!(r.content_type, "application/json", "{r:?}");
        let e = &r.json()["error"];
        let message = e["message"].as_str().unwrap();
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
        assert!(e["type"].is_string(), "{r:?}");
    };
    // the scheduler's validation, passed through with the field it names
    // as OpenAI's `param`
    let param = |r: &Reply| r.json()["error"]["param"].clone();
    let r = f
        .post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "max_tokens": 0}),
        )
        .await;
    expect(&r, 400, "max_tokens must be at least 1");
    assert_eq!(param(&r), "max_tokens", "{r:?}");
    let r = f
        .post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "temperature": -1}),
        )
        .await;
    expect(&r, 400, "temperature");
    assert_eq!(param(&r), "temperature", "{r:?}");
    let r = f
        .post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "max_tokens": 600}),
        )
        .await;
    expect(&r, 400, "max_tokens 600 is over the limit of 200");
    assert_eq!(param(&r), "max_tokens", "{r:?}");
    let r = f
        .post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": [300], "max_tokens": 1}),
        )
        .await;
    expect(&r, 400, "outside the vocabulary");
    assert_eq!(param(&r), "prompt", "{r:?}");
    // structured output: a schema llguidance cannot compile names
    // response_format and the engine's problem; a well-formed one is served
    let r = f
        .post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "max_tokens": 8,
                "response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}),
        )
        .await;
    expect(&r, 400, "invalid json_schema: Invalid type: strnig");
    assert_eq!(param(&r), "response_format", "{r:?}");
    let r = f
        .post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "max_tokens": 8,
                "kvlease": {"grammar": {"regex": "(a"}}}),
        )
        .await;
    expect(&r, 400, "invalid regex");
    assert_eq!(param(&r), "kvlease.grammar.regex", "{r:?}");
    let r = f
        .post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "max_tokens": 40, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                    "schema": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                        "required": ["n"], "additionalProperties": false}}}}),
        )
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let choice = &r.json()["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{r:?}");
    let text = choice["text"].as_str().unwrap();
    assert!(text == r#"{"n":1}"# || text == r#"{"n":2}"#, "{text:?}");
    // the sampling set out of range (the seeded model has no chat template:
    // chat reads these fields with the same code, `request.rs`)
    for (field, value) in [
        ("frequency_penalty", json!(2.5)),
        ("presence_penalty", json!(-9)),
        ("repetition_penalty", json!(-1)),
        ("min_p", json!(1.5)),
        ("logit_bias", json!({"1": -101})),
        ("logit_bias", json!({"100000": 1})),
        ("min_tokens", json!(900)),
    ] {
        let mut body = json!({"model": "kvlease", "prompt": "x", "max_tokens": 4});
        body[field] = value;
        let r = f.post("/v1/completions", body).await;
        expect(&r, 400, field);
        assert_eq!(param(&r), field, "{r:?}");
    }
    // the gateway's own checks
    expect(
        &request(f.http, "POST", "/v1/completions", Some("{not json".into())).await,
        400,
        "invalid request body",
    );
    expect(
        &f.post(
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "n": 17}),
        )
        .await,
        400,
        "n must be 1 to 16",
    );
    expect(
        &f.post("/v1/completions", json!({"model": "gpt-4", "prompt": "x"}))
            .await,
        404,
        "does not exist",
    );
    expect(
        &f.post("/v1/chat/completions", json!({"model": "kvlease"}))
            .await,
        400,
        "messages",
    );
    expect(&f.get("/v1/embeddings").await, 404, "no such route");
    // the byte-level model has no chat template: the scheduler says so
    let chat = json!({"model": "kvlease", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    expect(
        &f.post("/v1/chat/completions", chat).await,
        400,
        "no chat template",
    );
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_whole_and_streamed_match_grpc() {
    let f = Front::start(Some(chatml_tokenizer().unwrap())).await;
    let messages = [("system", "You are brief."), ("user", "Name a colour.")];
    let grpc = f
        .grpc(pb::GenerateRequest {
            messages: messages
                .iter()
                .map(|(role, content)| pb::ChatMessage {
                    role: (*role).into(),
                    content: (*content).into(),
                })
                .collect(),
            max_tokens: 8,
            ..Default::default()
        })
        .await;
    // "<|im_start|>system\nYou are brief.<|im_end|>\n" + the user turn + the
    // generation prompt, one token per byte and per special
    let rendered = 2
        + "system\nYou are brief.\n".len()
        + 2
        + "user\nName a colour.\n".len()
        + 1
        + "assistant\n".len();
    assert_eq!(grpc.prompt_tokens as usize, rendered);
    let body = json!({
        "model": "kvlease", "max_tokens": 8, "temperature": 0, "user": "alice",
        "messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>(),
    });
    let whole = f.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    let w = whole.json();
    assert_eq!(w["object"], "chat.completion");
    assert_eq!(w["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        w["choices"][0]["message"]["content"].as_str(),
        Some(grpc.text.as_str())
    );
    let finish = match grpc.finish_reason() {
        pb::FinishReason::Length => "length",
        pb::FinishReason::Stop => "stop",
        other => panic!("{other:?}"),
    };
    assert_eq!(w["choices"][0]["finish_reason"], finish);
    assert_eq!(w["usage"]["prompt_tokens"], rendered);
    assert_eq!(w["usage"]["completion_tokens"], grpc.tokens.len());
    // `user` is only a label (issue 29, finding 5): without a token file every caller
    // is one tenant, so "alice" reuses the gRPC call's blocks (tenants by token:
    // integration-tests/tests/hostile_gateway.rs)
    let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached.is_some_and(|c| c > 0), "{}", w["usage"]);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let sse = f.post("/v1/chat/completions", streamed).await;
    assert_eq!(sse.status, 200, "{sse:?}");
    let chunks = sse.chunks();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, grpc.text);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        finish
    );
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "no usage unless asked"
    );
    // alice's second request reuses her own cached prefix
    let again = f.post("/v1/chat/completions", body).await.json();
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{again}"
    );
    f.stop().await;
}

/// OpenAI's `n` through the gateway: n choices with their index, the same
/// as the scheduler's samples over gRPC, streamed by index with each
/// choice's finish, usage counting the prompt once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_whole_and_streamed_match_the_grpc_samples() {
    let f = Front::start(None).await;
    let prompt = "Forked samples share the prompt's blocks.";
    let body = json!({"model": "kvlease", "prompt": prompt, "max_tokens": 6, "temperature": 1.0,
        "seed": 3, "n": 3, "ignore_eos": true});
    let whole = f.post("/v1/completions", body.clone()).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    let w = whole.json();
    let choices = w["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{w}");
    // each choice is the gRPC sample of its index: sample i of a request
    // of one sample with its seed
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
        let one = f
            .grpc(pb::GenerateRequest {
                text: prompt.into(),
                max_tokens: 6,
                temperature: 1.0,
                seed: scheduler_svc::queue::branch_seed(3, i as u32),
                ignore_eos: true,
                ..Default::default()
            })
            .await;
        assert_eq!(c["text"].as_str(), Some(one.text.as_str()), "choice {i}");
    }
    assert_eq!(w["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(w["usage"]["completion_tokens"], 3 * 6);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let sse = f.post("/v1/completions", streamed).await;
    assert_eq!(sse.status, 200, "{sse:?}");
    let chunks = sse.chunks();
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 3 * 6);
    let mut texts = vec![String::new(); 3];
    let mut finishes = vec![0; 3];
    for c in rest {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        texts[i].push_str(choice["text"].as_str().unwrap_or(""));
        finishes[i] += usize::from(choice["finish_reason"] == "length");
    }
    let want: Vec<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, want);
    assert_eq!(finishes, vec![1, 1, 1], "each choice ends once");
    f.stop().await;
}

/// vLLM's `use_beam_search` through the gateway: the `n` choices are the
/// best hypotheses of a search of width `best_of`, the same as the
/// scheduler's ranks over gRPC; what beams cannot serve is a 400 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beam_search_choices_match_the_grpc_ranks() {
    let f = Front::start(None).await;
    let prompt = "Beams fork and share the prompt's blocks.";
    let body = json!({"model": "kvlease", "prompt": prompt, "max_tokens": 6,
        "use_beam_search": true, "best_of": 4, "n": 2, "ignore_eos": true});
    let whole = f.post("/v1/completions", body.clone()).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    let w = whole.json();
    let choices = w["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{w}");
    let mut grpc = scheduler_client(f.scheduler.addr)
        .await
        .unwrap()
        .generate(pb::GenerateRequest {
            text: prompt.into(),
            max_tokens: 6,
            beam_width: 4,
            n: 2,
            ignore_eos: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut texts = vec![String::new(); 2];
    while let Some(m) = grpc.message().await.unwrap() {
        texts[m.index as usize].push_str(&m.text);
    }
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"].as_str(), Some(texts[i].as_str()), "choice {i}");
    }
    assert_ne!(texts[0], texts[1], "two hypotheses");
    for (extra, param) in [
        (json!({"stream": true}), "stream"),
        (json!({"best_of": 11}), "best_of"),
        (json!({"temperature": 0.7}), "temperature"),
        (json!({"use_beam_search": 1}), "use_beam_search"),
    ] {
        let mut bad = body.clone();
        for (k, v) in extra.as_object().unwrap() {
            bad[k] = v.clone();
        }
        let r = f.post("/v1/completions", bad).await;
        assert_eq!(r.status, 400, "{r:?}");
        assert_eq!(r.json()["error"]["param"], param, "{r:?}");
    }
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_is_a_400_for_streams_too() {
    let f = Front::start(None).await;
    // warm-up proved that a request of the whole context fits an empty pool,
    // so what can never fit is refused by the scheduler's validation
    let prompt = "x".repeat(250);
    for stream in [false, true] {
        let r = f
            .post(
                "/v1/completions",
                json!({"model": "kvlease", "prompt": prompt, "max_tokens": 10, "stream": stream}),
            )
            .await;
        assert_eq!(r.status, 400, "{r:?}");
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains("exceeds the context limit of 256 tokens"), "{m}");
    }
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_exhausted_mid_stream_ends_the_stream_with_an_error_event() {
    // two requests of 100 + 150 tokens need 16 blocks each at the end, the
    // pool has 23: under max-utilization with on-exhausted=reject, one of
    // them is rejected after it has streamed tokens
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let (gated, gate) = tap::start_gate(worker.addr).await.unwrap();
    let config = scheduler_svc::Config {
        on_exhausted: scheduler_svc::policy::OnExhausted::Reject,
        ..scheduler_config()
    };
    let f = Front::over(cache, worker, Some(&gated), config).await;
    let body = |p: &str| {
        json!({"model": "kvlease", "prompt": p.repeat(100), "max_tokens": 150,
               "temperature": 0, "stream": true})
    };
    // A's first forward pass is held until B is the scheduler's: both run
    gate.close();
    let a = tokio::spawn(request(
        f.http,
        "POST",
        "/v1/completions",
        Some(body("a").to_string()),
    ));
    gate.holding().await;
    let b = tokio::spawn(request(
        f.http,
        "POST",
        "/v1/completions",
        Some(body("b").to_string()),
    ));
    // B is the scheduler's: submitted (the status's queue counts what the
    // loop, waiting on A's pass, has not taken in yet), queued, or already
    // leased (a pipelined loop admits while A's pass is held)
    let mut status = scheduler_client(f.scheduler.addr).await.unwrap();
    while {
        let s = status
            .get_status(pb::GetStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        s.queued + s.running < 2
    } {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gate.open();
    let replies = [a.await.unwrap(), b.await.unwrap()];
    let mut rejected = 0;
    for r in &replies {
        assert_eq!(r.status, 200, "{r:?}");
        let chunks = r.chunks();
        let last = chunks.last().unwrap();
        if let Some(e) = last.get("error") {
            rejected += 1;
            assert_eq!(e["code"], "pool_exhausted", "{r:?}");
            assert!(
                e["message"].as_str().unwrap().contains("retry later"),
                "{e}"
            );
            assert!(chunks.len() > 1, "tokens came before the reject: {r:?}");
        } else {
            assert_eq!(last["choices"][0]["finish_reason"], "length", "{r:?}");
        }
    }
    assert_eq!(rejected, 1, "{replies:?}");
    f.stop().await;
    gated.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_and_health_are_503_while_the_scheduler_is_unreachable() {
    let f = Front::start(None).await;
    for path in ["/health", "/v1/models", "/v1/models/kvlease"] {
        assert_eq!(f.get(path).await.status, 200, "{path}");
    }
    let Front {
        http,
        scheduler,
        worker,
        cache,
        gateway,
    } = f;
    scheduler.stop().await.unwrap();
    // a model is listed only while it can be served (issue 25, point 5)
    for path in ["/health", "/v1/models", "/v1/models/kvlease"] {
        let r = request(http, "GET", path, None).await;
        assert_eq!(r.status, 503, "{path}: {r:?}");
        assert_eq!(r.json()["error"]["code"], "service_unavailable", "{r:?}");
    }
    gateway.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
}

/// Logprobs over HTTP in both shapes, whole and streamed, equal gRPC's:
/// completions with `logprobs` 5 and `echo` (the prompt's text and
/// logprobs first, its first token null), chat with `logprobs` and
/// `top_logprobs`; a streamed answer's logprobs, chunk after chunk, are the
/// whole answer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_and_echo_in_the_completions_and_chat_shapes() {
    let f = Front::start(Some(chatml_tokenizer().unwrap())).await;
    let grpc = f
        .grpc(pb::GenerateRequest {
            text: PROMPT.into(),
            max_tokens: 5,
            ignore_eos: true,
            logprobs: Some(pb::LogprobsRequest {
                top: 5,
                prompt: false,
            }),
            ..Default::default()
        })
        .await;
    let body = json!({"model": "kvlease", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
        "ignore_eos": true, "logprobs": 5, "echo": true});
    let whole = f.post("/v1/completions", body.clone()).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    let choice = &whole.json()["choices"][0];
    let text = choice["text"].as_str().unwrap();
    assert_eq!(text, format!("{PROMPT}{}", grpc.text));
    let lp = &choice["logprobs"];
    let n = PROMPT.len() + 5;
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), n, "{key}: {lp}");
    }
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    // the byte-level tokenizer: a token a character, offsets count them
    let offsets: Vec<u64> = (0..n as u64).collect();
    assert_eq!(lp["text_offset"], json!(offsets));
    for i in 1..n {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((5..=6).contains(&top.len()), "{top:?}");
        let mass: f64 = top.values().map(|v| v.as_f64().unwrap().exp()).sum();
        assert!(mass <= 1.0 + 1e-6, "{mass}");
        let token = lp["tokens"][i].as_str().unwrap();
        assert_eq!(
            top[token], lp["token_logprobs"][i],
            "the chosen token is listed"
        );
    }
    let generated: Vec<f64> = (PROMPT.len()..n)
        .map(|i| lp["token_logprobs"][i].as_f64().unwrap())
        .collect();
    let from_grpc: Vec<f64> = grpc_logprobs(&f, PROMPT, 5).await;
    assert_eq!(generated, from_grpc, "HTTP carries gRPC's values");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = f.post("/v1/completions", streamed).await.chunks();
    let mut tokens = Vec::new();
    let mut offsets_streamed = Vec::new();
    for c in &chunks {
        let l = &c["choices"][0]["logprobs"];
        if l.is_object() {
            tokens.extend(l["tokens"].as_array().unwrap().clone());
            offsets_streamed.extend(l["text_offset"].as_array().unwrap().clone());
        }
    }
    assert_eq!(Value::Array(tokens), lp["tokens"]);
    assert_eq!(Value::Array(offsets_streamed), lp["text_offset"]);
    let streamed_text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed_text, text);

    // chat: content entries with bytes and top_logprobs
    let chat = json!({"model": "kvlease", "max_tokens": 4, "temperature": 0, "ignore_eos": true,
        "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 3});
    let whole = f.post("/v1/chat/completions", chat.clone()).await;
    assert_eq!(whole.status, 200, "{whole:?}");
    let choice = &whole.json()["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for e in content {
        let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
        assert_eq!(e["token"].as_str().unwrap().as_bytes(), bytes.as_slice());
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(
            top[0]["token"], e["token"],
            "greedy: the chosen token leads"
        );
        assert_eq!(top[0]["logprob"], e["logprob"]);
    }
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let chunks = f.post("/v1/chat/completions", streamed).await.chunks();
    let streamed_content: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed_content, content);
    // without logprobs, none
    let plain = f
        .post(
            "/v1/chat/completions",
            json!({"model": "kvlease", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(plain.json()["choices"][0]["logprobs"], Value::Null);
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"model": "kvlease", "messages": [{"role": "user", "content": "hi"}],
                "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "logprobs": 6}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": "kvlease", "prompt": "x", "logprobs": -2}),
            "logprobs",
        ),
    ] {
        let r = f.post(path, body).await;
        assert_eq!(r.status, 400, "{r:?}");
        assert_eq!(r.json()["error"]["param"], param, "{r:?}");
    }
    f.stop().await;
}

/// The logprobs of the greedy tokens gRPC generates after `prompt`.
async fn grpc_logprobs(f: &Front, prompt: &str, max_tokens: u32) -> Vec<f64> {
    let mut c = scheduler_client(f.scheduler.addr).await.unwrap();
    let mut s = c
        .generate(pb::GenerateRequest {
            text: prompt.into(),
            max_tokens,
            ignore_eos: true,
            logprobs: Some(pb::LogprobsRequest {
                top: 0,
                prompt: false,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = s.message().await.unwrap() {
        out.extend(m.logprobs.iter().map(|l| f64::from(l.logprob.unwrap())));
    }
    out
}
