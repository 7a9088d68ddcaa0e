//! The command's pieces against a real in-process cluster: `up`'s cluster on
//! ephemeral ports, health checks, a bench from a synthetic workload and from
//! the sample Mooncake trace, status, and a clean shutdown.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use kvlease::bench::Load;
use kvlease::cluster::{Cluster, ClusterConfig};
use kvlease::commands::{self, Source};
use kvlease::mooncake::Expand;
use kvlease::workload::Synthetic;
use kvlease::{Error, connect, demo, status};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn small_cluster(workers: usize) -> ClusterConfig {
    let mut config = ClusterConfig::on_ports(IpAddr::V4(Ipv4Addr::LOCALHOST), 0, workers);
    config.worker = demo::demo_worker(8);
    config.scheduler.max_tokens = 64;
    config.ready_within = Duration::from_secs(60);
    config
}

fn quiet() -> Load {
    Load {
        concurrency: 4,
        progress: false,
        timeout: Duration::from_secs(60),
        ..Load::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_serves_benches_status_and_health() -> TestResult {
    let cluster = Cluster::start(small_cluster(2)).await?;
    assert_eq!(cluster.workers.len(), 2);
    for addr in [
        cluster.scheduler,
        cluster.cache,
        cluster.workers[0],
        cluster.workers[1],
    ] {
        assert!(
            commands::health(&addr.to_string(), "", Duration::from_secs(2)).await?,
            "{addr} is not SERVING"
        );
    }
    let scheduler = cluster.scheduler.to_string();

    let synthetic = Synthetic {
        requests: 8,
        prefixes: 1,
        prefix_tokens: 32,
        tail_min: 4,
        tail_max: 12,
        output_min: 2,
        output_max: 6,
        seed: 3,
    };
    let s = commands::bench(&scheduler, Source::Synthetic(synthetic), quiet()).await?;
    assert_eq!((s.requests, s.ok, s.errors_total()), (8, 8, 0), "{s}");
    assert_eq!(s.latency.len(), 8);
    let cluster_delta = s
        .cluster
        .clone()
        .ok_or("no GetStatus figures around the bench")?;
    assert!(
        cluster_delta.reuse_hits > 0,
        "a shared prefix was never reused: {s}"
    );

    let trace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/sample-mooncake.jsonl");
    let source = Source::Trace {
        path: trace,
        expand: Expand {
            scale: 64,
            max_prompt: 96,
            max_output: 4,
            speedup: 1.0,
        },
        limit: 10,
        replay: false,
    };
    let s = commands::bench(&scheduler, source, quiet()).await?;
    assert_eq!((s.requests, s.ok), (10, 10), "{s}");

    let mut client = connect::scheduler(&scheduler).await?;
    let st = connect::status(&mut client).await?;
    assert_eq!(st.finished_length + st.finished_stop, 18, "{st:?}");
    assert_eq!(st.pools.len(), 4, "two workers, two pools each: {st:?}");
    assert!(status::render(&st).contains("seeded-0/replica-1"));

    let cache = cluster.cache;
    cluster.shutdown().await;
    let gone = connect::health(&cache.to_string(), "", Duration::from_millis(500)).await;
    assert!(
        gone.is_err(),
        "the cache still answers after shutdown: {gone:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_up_that_cannot_fit_is_a_start_error_not_a_hang() -> TestResult {
    // a pool far too small for the scheduler's largest warm-up shape: one
    // sequence at the longest context needs 512 blocks of 8 KiB in the
    // full-attention pool, more than the whole 4 MiB budget
    let mut config = small_cluster(1);
    config.worker = demo::demo_worker(4);
    config.worker.max_context = 8192;
    match Cluster::start(config).await {
        Err(Error::Service { service, message }) => {
            assert_eq!(service, "scheduler");
            assert!(message.contains("warm-up"), "{message}");
        }
        other => panic!("expected the scheduler's start-up error, got {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_too_small_is_the_first_error_and_names_the_least_that_starts() -> TestResult {
    let mut config = small_cluster(1);
    config.worker.memory_budget_mib = 1;
    let at_least = match Cluster::start(config.clone()).await {
        Err(Error::MemoryBudget {
            budget_mib: 1,
            at_least_mib,
            ..
        }) => at_least_mib,
        other => panic!("expected the worker's budget as the first error, got {other:?}"),
    };
    assert!(at_least > 1, "{at_least}");
    // the least it names is enough: the worker starts and warm-up fits
    config.worker.memory_budget_mib = at_least;
    let cluster = Cluster::start(config).await?;
    cluster.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_up_example_starts() -> TestResult {
    let readme = include_str!("../README.md");
    let line = readme
        .lines()
        .find(|l| l.contains("-- up --workers 1"))
        .ok_or("no `up --workers 1` example in the README")?;
    let flag = |name: &str| {
        let mut words = line.split_whitespace();
        words.find(|w| *w == name).and(words.next())
    };
    let budget: u64 = flag("--memory-budget-mib")
        .ok_or("the example gives no --memory-budget-mib")?
        .parse()?;
    // what `up` starts, on any free ports, with the most compute threads a
    // worker takes (the most activation memory)
    let mut config = ClusterConfig::on_ports(IpAddr::V4(Ipv4Addr::LOCALHOST), 0, 1);
    config.worker.memory_budget_mib = budget;
    config.worker.threads = worker_svc::worker::DEFAULT_MAX_THREADS;
    let cluster = Cluster::start(config).await?;
    cluster.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn a_missing_trace_file_is_a_clear_error() {
    let source = Source::Trace {
        path: PathBuf::from("/nonexistent/trace.jsonl"),
        expand: Expand::default(),
        limit: 0,
        replay: false,
    };
    let r = commands::bench("127.0.0.1:1", source, quiet()).await;
    assert!(matches!(r, Err(Error::TraceIo { .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_demo_ends_with_the_pool_whole() -> TestResult {
    let options = demo::DemoOptions {
        requests: 6,
        concurrency: 6,
        modes: vec![scheduler_svc::policy::OnExhausted::Reject],
        ..demo::DemoOptions::default()
    };
    assert!(demo::run(options).await?, "the demo did not end clean");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_smollm2_names_the_least_budget_sizes_its_own_and_says_paris() -> TestResult {
    let home = kvlease::models::home(|k| std::env::var_os(k))?;
    let path = match kvlease::models::resolve("smollm2", &home) {
        Ok(path) => path,
        Err(e) => {
            // fails instead under KVLEASE_REQUIRE_MODEL=1
            kvlease_tokenizer::testing::model_missing(&format!("SmolLM2 is not cached ({e})"));
            return Ok(());
        }
    };
    let mut config = ClusterConfig::on_ports(IpAddr::V4(Ipv4Addr::LOCALHOST), 0, 1);
    config.worker.threads = 2;
    // a short context keeps the warm-up's prefill quick in a debug build
    config.scheduler.max_context = 256;
    config.scheduler.max_tokens = 64;
    config.ready_within = Duration::from_secs(120);

    // the seeded model's budget cannot hold it: the error names the least
    config.serve_model(path.clone(), Some(64))?;
    let at_least = match Cluster::start(config.clone()).await {
        Err(Error::MemoryBudget {
            budget_mib: 64,
            at_least_mib,
            ..
        }) => at_least_mib,
        other => panic!("expected the worker's budget error, got {other:?}"),
    };
    assert_eq!(
        at_least,
        kvlease::cluster::budget_for(&config.worker, 256, 1)?
    );

    // with no budget given, `up --model` takes room for a few sequences
    let budget = config.serve_model(path, None)?;
    assert_eq!(
        budget,
        kvlease::cluster::budget_for(
            &config.worker,
            256,
            kvlease::cluster::MODEL_BUDGET_SEQUENCES
        )?
    );
    assert!(budget > at_least, "{budget} <= {at_least}");
    let cluster = Cluster::start(config).await?;
    let mut client = connect::scheduler(&cluster.scheduler.to_string()).await?;
    let mut stream = client
        .generate(kvlease_proto::v1::GenerateRequest {
            text: "The capital of France is".into(),
            max_tokens: 4,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut text = String::new();
    while let Some(message) = stream.message().await? {
        text.push_str(&message.text);
    }
    println!("The capital of France is{text:?}");
    assert!(text.contains("Paris"), "{text:?}");
    cluster.shutdown().await;
    Ok(())
}

/// `kvlease up --model DIR` on two of the worker's architecture fixtures
/// (`worker-svc/tests/data/arch/`): the scheduler renders the chat with the
/// model's own template and the tokens it streams are the greedy tokens
/// transformers computed for that chat (`reference.json`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_the_qwen2_and_gemma3_fixtures_with_their_chat_template() -> TestResult {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../worker-svc/tests/data/arch");
    for name in ["qwen2", "gemma3"] {
        let dir = fixtures.join(name);
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
        let chat = reference["prompts"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["name"] == "chat"))
            .ok_or("no chat prompt in the fixture")?;
        let messages = chat["messages"]
            .as_array()
            .ok_or("no messages")?
            .iter()
            .map(|m| kvlease_proto::v1::ChatMessage {
                role: m["role"].as_str().unwrap_or_default().into(),
                content: m["content"].as_str().unwrap_or_default().into(),
            })
            .collect();
        let want: Vec<u32> = chat["greedy"]
            .as_array()
            .ok_or("no greedy tokens")?
            .iter()
            .take(8)
            .map(|t| t.as_u64().unwrap_or(u64::MAX) as u32)
            .collect();

        let mut config = ClusterConfig::on_ports(IpAddr::V4(Ipv4Addr::LOCALHOST), 0, 1);
        config.worker.threads = 2;
        config.scheduler.max_context = 256;
        config.scheduler.max_tokens = 64;
        config.ready_within = Duration::from_secs(120);
        config.serve_model(dir, None)?;
        let cluster = Cluster::start(config).await?;
        let mut client = connect::scheduler(&cluster.scheduler.to_string()).await?;
        let mut stream = client
            .generate(kvlease_proto::v1::GenerateRequest {
                messages,
                max_tokens: 8,
                ignore_eos: true,
                ..Default::default()
            })
            .await?
            .into_inner();
        let (mut tokens, mut prompt_tokens) = (Vec::new(), 0);
        while let Some(message) = stream.message().await? {
            tokens.extend(message.tokens);
            prompt_tokens = prompt_tokens.max(message.prompt_tokens);
        }
        println!("{name}: {prompt_tokens} prompt tokens, streamed {tokens:?}");
        let prompt_ids = chat["ids"].as_array().map_or(0, Vec::len);
        assert_eq!(
            prompt_tokens as usize, prompt_ids,
            "{name}: the rendered chat's length"
        );
        assert_eq!(tokens, want, "{name}: greedy tokens through the scheduler");
        cluster.shutdown().await;
    }
    Ok(())
}
