//! What the cache's gRPC tests share: a server on 127.0.0.1:0, and one
//! builder per request kind, so a test names only what it is about.
// Each test file is its own crate and uses part of this module.
#![allow(dead_code, unreachable_pub)]

use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::transport::Channel;

/// A cache service on 127.0.0.1:0 with a client connected to it.
pub struct Server {
    pub client: CacheServiceClient<Channel>,
    pub addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), cache_svc::Error>>>,
}

impl Server {
    pub async fn start(config: cache_svc::Config) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(cache_svc::run(listener, config, async {
            let _ = stopped.await;
        }));
        let client = CacheServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        Self {
            client,
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// A server with [`GROUP`] registered (`blocks` blocks a pool) and a
    /// session open.
    pub async fn with_session(config: cache_svc::Config, blocks: u32) -> (Self, Sess) {
        let mut s = Self::start(config).await;
        register(&mut s.client, blocks).await;
        let sess = open(&mut s.client).await;
        (s, sess)
    }

    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }
}

/// The tests' configuration: the defaults with a batch limit of 8.
pub fn config() -> cache_svc::Config {
    cache_svc::Config {
        max_batch: 8,
        ..cache_svc::Config::default()
    }
}

/// The group [`register`] registers.
pub const GROUP: &str = "m/r0";

/// A session: its id and epoch.
pub type Sess = (u64, u64);

// === requests ===

pub fn pool_spec(window: u64, num_blocks: u64) -> pb::PoolSpec {
    pb::PoolSpec {
        host_blocks: 0,
        window,
        num_blocks,
        ..Default::default()
    }
}

pub fn register_req(
    group: &str,
    tokens_per_block: u64,
    pools: Vec<pb::PoolSpec>,
) -> pb::RegisterPoolRequest {
    pb::RegisterPoolRequest {
        pool_group: group.into(),
        tokens_per_block,
        pools,
        ..Default::default()
    }
}

/// A sequence of [`GROUP`] with a prompt of `tokens`.
pub fn seq(seq_id: u64, tokens: Vec<u32>) -> pb::SequenceSpec {
    seq_in(GROUP, seq_id, tokens)
}

pub fn seq_in(group: &str, seq_id: u64, tokens: Vec<u32>) -> pb::SequenceSpec {
    pb::SequenceSpec {
        seq_id,
        pool_group: group.into(),
        prompt_tokens: tokens,
        ..Default::default()
    }
}

pub fn lease_req(s: Sess, step: u64, sequences: Vec<pb::SequenceSpec>) -> pb::LeaseRequest {
    pb::LeaseRequest {
        session_id: s.0,
        epoch: s.1,
        step,
        atomic: false,
        sequences,
        warmup: false,
    }
}

/// An extend item growing `seq_id` by `new_tokens`.
pub fn ext_item(seq_id: u64, new_tokens: Vec<u32>) -> pb::ExtendItem {
    pb::ExtendItem {
        seq_id,
        new_tokens,
        ..Default::default()
    }
}

/// An extend item reporting `seq_id`'s KV written through `written_tokens`.
pub fn progress_item(seq_id: u64, written_tokens: u32) -> pb::ExtendItem {
    pb::ExtendItem {
        seq_id,
        written_tokens,
        ..Default::default()
    }
}

pub fn extend_req(s: Sess, step: u64, items: Vec<pb::ExtendItem>) -> pb::ExtendRequest {
    pb::ExtendRequest {
        session_id: s.0,
        epoch: s.1,
        step,
        atomic: false,
        items,
    }
}

pub fn release_req(s: Sess, seq_ids: Vec<u64>, fence_step: Option<u64>) -> pb::ReleaseRequest {
    pb::ReleaseRequest {
        session_id: s.0,
        epoch: s.1,
        seq_ids,
        fence_step,
        ..Default::default()
    }
}

pub fn complete_req(s: Sess, step: u64) -> pb::CompleteStepRequest {
    pb::CompleteStepRequest {
        session_id: s.0,
        epoch: s.1,
        step,
    }
}

pub fn keep_alive_req(s: Sess) -> pb::KeepAliveRequest {
    pb::KeepAliveRequest {
        session_id: s.0,
        epoch: s.1,
    }
}

pub fn close_req(s: Sess) -> pb::CloseSessionRequest {
    pb::CloseSessionRequest {
        session_id: s.0,
        epoch: s.1,
    }
}

/// A `Step` release part.
pub fn step_release(seq_ids: Vec<u64>, fence_step: Option<u64>) -> pb::StepRelease {
    pb::StepRelease {
        seq_ids,
        fence_step,
        ..Default::default()
    }
}

/// A `Step` extend part.
pub fn step_extend(step: u64, items: Vec<pb::ExtendItem>) -> pb::StepExtend {
    pb::StepExtend {
        step,
        atomic: false,
        items,
    }
}

pub fn step_req(
    s: Sess,
    release: Option<pb::StepRelease>,
    complete_step: Option<u64>,
    extend: Option<pb::StepExtend>,
) -> pb::StepRequest {
    pb::StepRequest {
        session_id: s.0,
        epoch: s.1,
        release,
        complete_step,
        extend,
    }
}

// === calls ===

/// Registers [`GROUP`]: 4 tokens a block, a full-attention pool and one of
/// window 8, `blocks` blocks each.
pub async fn register(c: &mut CacheServiceClient<Channel>, blocks: u32) -> Vec<pb::PoolInfo> {
    let blocks = u64::from(blocks);
    c.register_pool(register_req(
        GROUP,
        4,
        vec![pool_spec(0, blocks), pool_spec(8, blocks)],
    ))
    .await
    .unwrap()
    .into_inner()
    .pools
}

pub async fn open(c: &mut CacheServiceClient<Channel>) -> Sess {
    let r = open_session(c).await;
    (r.session_id, r.epoch)
}

pub async fn open_session(c: &mut CacheServiceClient<Channel>) -> pb::OpenSessionResponse {
    c.open_session(pb::OpenSessionRequest {
        holder: "test".into(),
        ttl_ms: 0,
    })
    .await
    .unwrap()
    .into_inner()
}

/// Leases `sequences` at `step` and returns their outcomes.
pub async fn lease(
    c: &mut CacheServiceClient<Channel>,
    s: Sess,
    step: u64,
    sequences: Vec<pb::SequenceSpec>,
) -> Vec<pb::SequenceOutcome> {
    c.lease(lease_req(s, step, sequences))
        .await
        .unwrap()
        .into_inner()
        .outcomes
}

pub async fn stats(c: &mut CacheServiceClient<Channel>) -> pb::GetStatsResponse {
    c.get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap()
        .into_inner()
}

// === answers ===

pub fn grant(o: &pb::SequenceOutcome) -> &pb::Grant {
    match &o.outcome {
        Some(pb::sequence_outcome::Outcome::Grant(g)) => g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

pub fn reject(o: &pb::SequenceOutcome) -> &pb::Reject {
    match &o.outcome {
        Some(pb::sequence_outcome::Outcome::Reject(r)) => r,
        other => panic!("expected a reject, got {other:?}"),
    }
}

pub fn assert_status<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, needle: &str) {
    let status = r.expect_err("expected an error status");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(needle),
        "{:?} does not mention {needle:?}",
        status.message()
    );
}
