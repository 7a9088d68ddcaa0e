//! The subcommands: `up`, `generate`, `bench`, `status`, `health`
//! (`demo` lives in [`crate::demo`]).

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use kvlease_proto::v1 as pb;
use tokio::time::Instant;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::bench::{self, Finish, Load};
use crate::cluster::{Cluster, ClusterConfig};
use crate::connect;
use crate::error::{Error, Result};
use crate::local_tls::LocalTls;
use crate::mooncake::{self, Expand};
use crate::report::{ClusterDelta, Summary};
use crate::status;
use crate::workload::Synthetic;

/// The HTTP front of `kvlease up`: where it listens and the names of the
/// model it serves (the first is the one answers carry).
#[derive(Debug, Clone)]
pub struct HttpFront {
    pub listen: std::net::SocketAddr,
    pub names: Vec<String>,
}

/// `kvlease up`: starts the cluster, prints its addresses and runs until
/// `shutdown` resolves or a service stops by itself (an error).
///
/// With `http` set, the OpenAI-compatible HTTP front (`kvlease-gateway`)
/// serves there too, in front of the scheduler. With `tls`, every service
/// serves mTLS with its own certificate of `tls` (set `config` up with
/// [`LocalTls::secure`]), and the gateway takes the admin's bearer token.
pub async fn up(
    config: ClusterConfig,
    http: Option<HttpFront>,
    tls: Option<&LocalTls>,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    // The HTTP listener is bound before anything starts, as the services'
    // are (`Cluster::start`): a port in use fails at once, not after the
    // whole cluster started and warmed up.
    let http = match http {
        Some(front) => {
            let listener = crate::cluster::bind(front.listen).await?;
            Some((front, listener))
        }
        None => None,
    };
    let workers = config.worker_listens.len();
    println!("kvlease up: starting cache, {workers} worker(s) and scheduler ...");
    let mut cluster = Cluster::start(config).await?;
    println!(
        "  scheduler  {}   (kvlease generate / bench / status talk to this)",
        cluster.scheduler
    );
    let (stop_gateway, gateway_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut gateway = None;
    if let Some((front, listener)) = http {
        let local = listener.local_addr().unwrap_or(front.listen);
        let mut names = front.names.into_iter();
        let config = kvlease_gateway::Config {
            listen: local,
            scheduler_addr: format!("http://{}", cluster.scheduler),
            security: tls.map(|t| t.args("gateway")).unwrap_or_default(),
            model: names
                .next()
                .unwrap_or_else(|| kvlease_gateway::config::DEFAULT_MODEL.to_string()),
            model_aliases: names.collect(),
            ..kvlease_gateway::Config::default()
        };
        println!(
            "  http       http://{local}/v1   (OpenAI-compatible; model {:?}{})",
            config.model,
            if config.model_aliases.is_empty() {
                String::new()
            } else {
                format!(", also {:?}", config.model_aliases)
            }
        );
        gateway = Some(tokio::spawn(kvlease_telemetry::in_service(
            "kvlease-gateway",
            kvlease_gateway::run(listener, config, async {
                let _ = gateway_stopped.await;
            }),
        )));
    }
    println!("  cache      {}", cluster.cache);
    for (i, w) in cluster.workers.iter().enumerate() {
        println!("  worker-{}   {w}", i + 1);
    }
    for (service, addr) in &cluster.metrics {
        println!("  metrics    http://{addr}/metrics   ({service})");
    }
    if let Some(tls) = tls {
        println!("{}", tls.usage());
    }
    println!("serving; Ctrl-C stops the cluster");
    let _ = std::io::stdout().flush();
    let outcome = tokio::select! {
        () = shutdown => Ok(()),
        e = cluster.stopped() => Err(e),
    };
    println!("kvlease up: stopping ...");
    let _ = stop_gateway.send(());
    if let Some(Ok(Err(e))) = match gateway {
        Some(task) => Some(task.await),
        None => None,
    } {
        tracing::warn!(error = %e, "the HTTP front stopped with an error");
    }
    cluster.shutdown().await;
    outcome
}

/// What `kvlease generate` sends.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub scheduler: String,
    pub text: String,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub cache_salt: String,
    /// Send the text as one user message of a chat (the model's template).
    pub chat: bool,
    /// Stop strings.
    pub stop: Vec<String>,
}

/// `kvlease generate`: streams the completion of `text` to stdout as it
/// arrives, then a line with how it finished. `Ok(false)` when it did not
/// complete (rejected, cancelled, error).
pub async fn generate(options: GenerateOptions) -> Result<bool> {
    let mut client = connect::scheduler(&options.scheduler).await?;
    let sent = Instant::now();
    let mut stream = client
        .generate(pb::GenerateRequest {
            text: if options.chat {
                String::new()
            } else {
                options.text.clone()
            },
            messages: if options.chat {
                vec![pb::ChatMessage {
                    role: "user".into(),
                    content: options.text.clone(),
                }]
            } else {
                Vec::new()
            },
            stop: options.stop.clone(),
            max_tokens: options.max_tokens,
            temperature: options.temperature,
            top_p: options.top_p,
            seed: options.seed,
            cache_salt: options.cache_salt.clone(),
            request_id: "kvlease-generate".into(),
            ..Default::default()
        })
        .await
        .map_err(|s| Error::rpc("Generate", s))?
        .into_inner();
    let mut out = std::io::stdout();
    if !options.chat {
        let _ = write!(out, "{}", options.text);
    }
    let mut tokens = 0usize;
    let mut first_token = None;
    let mut reused = 0;
    let mut finish = Finish::Failed("stream ended without a finish reason".into());
    let mut preemptions = 0;
    let mut first = true;
    while let Some(msg) = stream
        .message()
        .await
        .map_err(|s| Error::rpc("Generate", s))?
    {
        if first {
            reused = msg.reused_tokens;
            first = false;
        }
        if !msg.tokens.is_empty() && first_token.is_none() {
            first_token = Some(sent.elapsed());
        }
        tokens += msg.tokens.len();
        let _ = write!(out, "{}", msg.text);
        let _ = out.flush();
        if msg.finish_reason != 0 {
            finish = bench::finish_of(&msg);
            preemptions = msg.preemptions;
            if let Some(r) = &msg.reject {
                eprintln!(
                    "\nrejected: {} (pool {} window {}: needed {} blocks, {} free, {} pending free) {}",
                    pb::RejectReason::try_from(r.reason).map_or("UNSPECIFIED", |r| r.as_str_name()),
                    r.pool_id,
                    r.window,
                    r.blocks_needed,
                    r.blocks_free,
                    r.blocks_pending_free,
                    r.message
                );
            }
        }
    }
    println!();
    eprintln!(
        "[{finish:?}: {tokens} tokens in {:.0} ms, first after {}, {reused} prompt tokens reused, {preemptions} preemption(s)]",
        sent.elapsed().as_secs_f64() * 1000.0,
        first_token.map_or_else(
            || "-".into(),
            |d| format!("{:.0} ms", d.as_secs_f64() * 1000.0)
        ),
    );
    Ok(finish.is_ok())
}

/// Where `kvlease bench` takes its requests from.
#[derive(Debug, Clone)]
pub enum Source {
    Synthetic(Synthetic),
    /// A Mooncake trace; `replay` keeps its arrival times.
    Trace {
        path: PathBuf,
        expand: Expand,
        limit: usize,
        replay: bool,
    },
}

/// `kvlease bench`: drives the workload, prints the closing table and the
/// summary line, and returns the summary.
pub async fn bench(scheduler: &str, source: Source, load: Load) -> Result<Summary> {
    let requests = match &source {
        Source::Synthetic(s) => s.requests(),
        Source::Trace {
            path,
            expand,
            limit,
            replay,
        } => {
            let records = mooncake::read(path)?;
            let mut requests = mooncake::expand(&records, *expand);
            if *limit > 0 {
                requests.truncate(*limit);
            }
            if !replay {
                requests.iter_mut().for_each(|r| r.at = None);
            }
            requests
        }
    };
    if requests.is_empty() {
        return Err(Error::Usage("the workload has no requests".into()));
    }
    let mut client = connect::scheduler(scheduler).await?;
    let before = connect::status(&mut client).await.ok();
    let prompt: usize = requests.iter().map(|r| r.tokens.len()).sum();
    eprintln!(
        "kvlease bench: {} requests ({} prompt tokens) to {scheduler}, concurrency {}{}",
        requests.len(),
        prompt,
        load.concurrency,
        load.rate
            .map_or_else(String::new, |r| format!(", {r} req/s")),
    );
    let t0 = Instant::now();
    let outcomes = bench::drive(client.clone(), requests, &load).await;
    let wall = t0.elapsed();
    let after = connect::status(&mut client).await.ok();
    let delta = match (&before, &after) {
        (Some(b), Some(a)) => Some(ClusterDelta::between(b, a)),
        _ => None,
    };
    let summary = Summary::new(&outcomes, wall, delta);
    println!("{summary}");
    println!("{}", summary.line());
    Ok(summary)
}

/// `kvlease status`: the scheduler's status and pool figures.
pub async fn status(scheduler: &str) -> Result<()> {
    let mut client = connect::scheduler(scheduler).await?;
    let s = connect::status(&mut client).await?;
    print!("{}", status::render(&s));
    Ok(())
}

/// `kvlease audit`: the cache's sessions and pools, and its leak audit;
/// `Ok(false)` when the audit reclaimed blocks or (`whole`) a pool has
/// blocks in use or fenced.
pub async fn audit(cache: &str, whole: bool) -> Result<bool> {
    let mut client = connect::cache(cache).await?;
    let audit = client
        .audit(pb::AuditRequest {})
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| Error::rpc("Audit", s))?;
    let stats = connect::stats(&mut client).await?;
    let problems = status::audit_problems(&stats, &audit, whole);
    print!("{}", status::render_audit(&stats, &audit, &problems));
    Ok(problems.is_empty())
}

/// `kvlease health`: `Ok(true)` when `addr` reports SERVING.
pub async fn health(addr: &str, service: &str, within: Duration) -> Result<bool> {
    let serving = connect::health(addr, service, within).await?;
    println!("{addr}: {}", serving.as_str_name());
    Ok(serving == ServingStatus::Serving)
}
