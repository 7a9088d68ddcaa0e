//! Recording pass-through proxies in front of a real cache service and a
//! real worker: every call is forwarded unchanged and its answer returned
//! unchanged; the taps only note what was granted, released, completed and
//! forwarded, stamped with one global order, so a test can check *when* a
//! block changed hands relative to the forward passes that used it.
//!
//! A [`Gate`] is a pass-through proxy of a real worker whose forward passes
//! wait while the test holds it closed: a way to keep a request in flight
//! (and unfinished) for as long as a test needs, whatever the machine's
//! speed. [`Refusals`] make a cache tap refuse every call that carries a
//! release while the test says so, as a cache that keeps refusing one, or
//! lose the answers of calls that grow sequences after the cache applied
//! them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use kvlease_proto::v1::cache_service_server::{CacheService, CacheServiceServer};
use kvlease_proto::v1::worker_service_client::WorkerServiceClient;
use kvlease_proto::v1::worker_service_server::{WorkerService, WorkerServiceServer};
use kvlease_runtime::serve::{Listeners, ServerInfo, serve};
use tokio::sync::watch;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::{Error, READY_WITHIN, Service};

/// One recorded event; `at` orders all events of both taps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A Lease or Extend answer granted `seq` these (pool, block) pairs it
    /// did not hold before. `at` is taken when the request was sent, the
    /// earliest moment the cache could have handed them out.
    Acquired {
        at: u64,
        step: u64,
        seq: u64,
        blocks: Vec<(u32, u32)>,
    },
    /// Release of `seqs`, fenced at `fence`; `at` when the request was sent.
    Released {
        at: u64,
        seqs: Vec<u64>,
        fence: Option<u64>,
    },
    /// CompleteStep(step) was sent at `at`.
    Completed { at: u64, step: u64 },
    /// A forward pass of `step` ran from `start` to `end` (both taken at the
    /// tap: before forwarding the call, and after the worker answered).
    Forward {
        start: u64,
        end: u64,
        step: u64,
        seqs: Vec<(u64, Vec<(u32, u32)>)>,
    },
}

/// The shared log of both taps.
#[derive(Debug, Default, Clone)]
pub struct Log {
    clock: Arc<AtomicU64>,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Log {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }

    fn push(&self, e: Event) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(e);
    }

    /// Everything recorded so far.
    pub fn events(&self) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

fn blocks_of(tables: &[pb::BlockTable]) -> Vec<(u32, u32)> {
    tables
        .iter()
        .flat_map(|t| t.block_ids.iter().map(move |b| (t.pool_id, *b)))
        .collect()
}

/// The (pool, block) pairs each sequence holds, as the tap last saw them.
type Held = HashMap<u64, Vec<(u32, u32)>>;

/// A recording proxy of a cache service.
#[derive(Debug, Clone)]
pub struct CacheTap {
    inner: CacheServiceClient<Channel>,
    log: Log,
    held: Arc<Mutex<Held>>,
    refusals: Refusals,
}

/// The test's handle on a cache tap's refusals (see [`start_refusing_cache`]).
#[derive(Debug, Clone, Default)]
pub struct Refusals {
    on: Arc<std::sync::atomic::AtomicBool>,
    count: Arc<AtomicU64>,
    /// Answers still to lose, and those lost so far.
    to_lose: Arc<AtomicU64>,
    lost: Arc<AtomicU64>,
}

impl Refusals {
    /// While on, every `Release`, and every `Step` with a release part, is
    /// answered RESOURCE_EXHAUSTED without reaching the cache.
    pub fn refuse_releases(&self, on: bool) {
        self.on.store(on, Ordering::Release);
    }

    /// Calls refused so far.
    pub fn refused(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }

    /// The next `n` calls that grow a sequence (a `Lease`, an `Extend` or a
    /// `Step` with tokens to add) reach the cache, which applies them, and
    /// are answered DEADLINE_EXCEEDED: the answer lost on its way back.
    pub fn lose_growth_answers(&self, n: u64) {
        self.to_lose.store(n, Ordering::Release);
    }

    /// Answers lost so far.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::Acquire)
    }

    /// Whether to lose the answer of a growth the cache just applied.
    fn lose(&self) -> Result<(), Status> {
        let take = self
            .to_lose
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if take.is_err() {
            return Ok(());
        }
        self.lost.fetch_add(1, Ordering::AcqRel);
        Err(Status::deadline_exceeded("injected: the answer was lost"))
    }

    fn refuse(&self) -> Result<(), Status> {
        if !self.on.load(Ordering::Acquire) {
            return Ok(());
        }
        self.count.fetch_add(1, Ordering::AcqRel);
        Err(Status::resource_exhausted("injected: release refused"))
    }
}

impl CacheTap {
    fn acquired(&self, at: u64, step: u64, seqs: &[u64], outcomes: &[pb::SequenceOutcome]) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        for (seq, o) in seqs.iter().zip(outcomes) {
            if let Some(pb::sequence_outcome::Outcome::Grant(g)) = &o.outcome {
                let now = blocks_of(&g.tables);
                let before = held.insert(*seq, now.clone()).unwrap_or_default();
                let new: Vec<(u32, u32)> =
                    now.into_iter().filter(|b| !before.contains(b)).collect();
                if !new.is_empty() {
                    self.log.push(Event::Acquired {
                        at,
                        step,
                        seq: *seq,
                        blocks: new,
                    });
                }
            }
        }
    }
}

/// Whether an extend item adds tokens (not only a progress report).
fn grows(item: &pb::ExtendItem) -> bool {
    !item.new_tokens.is_empty() || item.num_tokens > 0
}

#[tonic::async_trait]
impl CacheService for CacheTap {
    async fn register_pool(
        &self,
        r: Request<pb::RegisterPoolRequest>,
    ) -> Result<Response<pb::RegisterPoolResponse>, Status> {
        self.inner.clone().register_pool(r.into_inner()).await
    }
    async fn unregister_pool(
        &self,
        r: Request<pb::UnregisterPoolRequest>,
    ) -> Result<Response<pb::UnregisterPoolResponse>, Status> {
        self.inner.clone().unregister_pool(r.into_inner()).await
    }
    async fn open_session(
        &self,
        r: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        self.inner.clone().open_session(r.into_inner()).await
    }
    async fn keep_alive(
        &self,
        r: Request<pb::KeepAliveRequest>,
    ) -> Result<Response<pb::KeepAliveResponse>, Status> {
        self.inner.clone().keep_alive(r.into_inner()).await
    }
    async fn close_session(
        &self,
        r: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        self.inner.clone().close_session(r.into_inner()).await
    }
    async fn lease(
        &self,
        r: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        let req = r.into_inner();
        let seqs: Vec<u64> = req.sequences.iter().map(|s| s.seq_id).collect();
        let (at, step) = (self.log.tick(), req.step);
        let resp = self.inner.clone().lease(req).await?;
        self.refusals.lose()?;
        self.acquired(at, step, &seqs, &resp.get_ref().outcomes);
        Ok(resp)
    }
    async fn extend(
        &self,
        r: Request<pb::ExtendRequest>,
    ) -> Result<Response<pb::ExtendResponse>, Status> {
        let req = r.into_inner();
        let seqs: Vec<u64> = req.items.iter().map(|s| s.seq_id).collect();
        let (at, step) = (self.log.tick(), req.step);
        let grows = req.items.iter().any(grows);
        let resp = self.inner.clone().extend(req).await?;
        if grows {
            self.refusals.lose()?;
        }
        self.acquired(at, step, &seqs, &resp.get_ref().outcomes);
        Ok(resp)
    }
    async fn release(
        &self,
        r: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.refusals.refuse()?;
        let req = r.into_inner();
        {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            for s in &req.seq_ids {
                held.remove(s);
            }
        }
        self.log.push(Event::Released {
            at: self.log.tick(),
            seqs: req.seq_ids.clone(),
            fence: req.fence_step,
        });
        self.inner.clone().release(req).await
    }
    async fn complete_step(
        &self,
        r: Request<pb::CompleteStepRequest>,
    ) -> Result<Response<pb::CompleteStepResponse>, Status> {
        let req = r.into_inner();
        self.log.push(Event::Completed {
            at: self.log.tick(),
            step: req.step,
        });
        self.inner.clone().complete_step(req).await
    }
    async fn step(
        &self,
        r: Request<pb::StepRequest>,
    ) -> Result<Response<pb::StepResponse>, Status> {
        let req = r.into_inner();
        if req.release.is_some() {
            self.refusals.refuse()?;
        }
        // noted in the order the cache applies the parts
        if let Some(release) = &req.release {
            {
                let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
                for s in &release.seq_ids {
                    held.remove(s);
                }
            }
            self.log.push(Event::Released {
                at: self.log.tick(),
                seqs: release.seq_ids.clone(),
                fence: release.fence_step,
            });
        }
        if let Some(step) = req.complete_step {
            self.log.push(Event::Completed {
                at: self.log.tick(),
                step,
            });
        }
        let extend = req.extend.as_ref().map(|e| {
            let seqs: Vec<u64> = e.items.iter().map(|i| i.seq_id).collect();
            (self.log.tick(), e.step, seqs)
        });
        let grows = req
            .extend
            .as_ref()
            .is_some_and(|e| e.items.iter().any(grows));
        let resp = self.inner.clone().step(req).await?;
        if grows {
            self.refusals.lose()?;
        }
        if let (Some((at, step, seqs)), Some(x)) = (extend, &resp.get_ref().extend) {
            self.acquired(at, step, &seqs, &x.outcomes);
        }
        Ok(resp)
    }
    async fn estimate(
        &self,
        r: Request<pb::EstimateRequest>,
    ) -> Result<Response<pb::EstimateResponse>, Status> {
        self.inner.clone().estimate(r.into_inner()).await
    }
    async fn get_stats(
        &self,
        r: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::GetStatsResponse>, Status> {
        self.inner.clone().get_stats(r.into_inner()).await
    }
    type WatchEventsStream = tonic::Streaming<pb::CacheEvent>;
    async fn watch_events(
        &self,
        r: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        self.inner.clone().watch_events(r.into_inner()).await
    }
    async fn audit(
        &self,
        r: Request<pb::AuditRequest>,
    ) -> Result<Response<pb::AuditResponse>, Status> {
        self.inner.clone().audit(r.into_inner()).await
    }
    async fn r#match(
        &self,
        r: Request<pb::MatchRequest>,
    ) -> Result<Response<pb::MatchResponse>, Status> {
        self.inner.clone().r#match(r.into_inner()).await
    }
}

/// A recording proxy of a worker that holds every forward pass `delay`
/// longer, so that the scheduler's overlapped work lands inside it, and
/// while its gate (if any) is closed.
#[derive(Debug, Clone)]
pub struct WorkerTap {
    inner: WorkerServiceClient<Channel>,
    log: Log,
    delay: Duration,
    gate: Option<GateSide>,
    /// Forward passes still to fail (see [`start_faulty`]).
    failures: Arc<AtomicU64>,
    /// Peer pulls still to cut after their first chunk (see
    /// [`Faults::cut_next_pulls`]).
    pull_cuts: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl WorkerService for WorkerTap {
    type PullBlocksStream = tokio_stream::wrappers::ReceiverStream<Result<pb::BlockChunk, Status>>;

    /// Passes a peer pull on, chunk by chunk; a pull to cut ends with
    /// UNAVAILABLE after its first chunk, as a source that died mid-pull.
    async fn pull_blocks(
        &self,
        r: Request<pb::PullBlocksRequest>,
    ) -> Result<Response<Self::PullBlocksStream>, Status> {
        let cut = self
            .pull_cuts
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        let mut upstream = self
            .inner
            .clone()
            .pull_blocks(r.into_inner())
            .await?
            .into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        tokio::spawn(async move {
            let mut passed = 0;
            loop {
                let next = match upstream.message().await {
                    Ok(Some(_)) if cut && passed == 1 => Err(Status::unavailable(
                        "injected: the source worker went away mid-pull",
                    )),
                    Ok(Some(chunk)) => Ok(chunk),
                    Ok(None) => return,
                    Err(status) => Err(status),
                };
                let end = next.is_err();
                if tx.send(next).await.is_err() || end {
                    return;
                }
                passed += 1;
            }
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn describe(
        &self,
        r: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        self.inner.clone().describe(r.into_inner()).await
    }
    async fn get_tokenizer(
        &self,
        r: Request<pb::GetTokenizerRequest>,
    ) -> Result<Response<pb::GetTokenizerResponse>, Status> {
        self.inner.clone().get_tokenizer(r.into_inner()).await
    }
    async fn forward(
        &self,
        r: Request<pb::ForwardRequest>,
    ) -> Result<Response<pb::ForwardResponse>, Status> {
        if let Some(gate) = &self.gate {
            gate.pass().await;
        }
        if self
            .failures
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            // the worker never sees this pass: none of its KV is written
            return Err(Status::unavailable("injected forward failure"));
        }
        let req = r.into_inner();
        let start = self.log.tick();
        let step = req.step;
        let seqs = req
            .sequences
            .iter()
            .map(|s| (s.seq_id, blocks_of(&s.tables)))
            .collect();
        tokio::time::sleep(self.delay).await;
        let resp = self.inner.clone().forward(req).await;
        self.log.push(Event::Forward {
            start,
            end: self.log.tick(),
            step,
            seqs,
        });
        resp
    }
}

/// Starts a cache tap in front of `cache` and a worker tap in front of
/// `worker`, sharing one log.
pub async fn start_taps(
    cache: SocketAddr,
    worker: SocketAddr,
    delay: Duration,
) -> Result<(Service, Service, Log), Error> {
    let log = Log::default();
    let cache_tap = CacheTap {
        inner: crate::cache_client(cache).await?,
        log: log.clone(),
        held: Arc::default(),
        refusals: Refusals::default(),
    };
    let worker_tap = WorkerTap {
        inner: crate::worker_client(worker).await?,
        log: log.clone(),
        delay,
        gate: None,
        failures: Arc::default(),
        pull_cuts: Arc::default(),
    };
    let c = serve_tap("cache tap", CacheServiceServer::new(cache_tap)).await?;
    let w = serve_worker_tap("worker tap", worker_tap).await?;
    Ok((c, w, log))
}

/// Starts a pass-through proxy in front of `cache` that refuses the calls
/// carrying a release while the returned [`Refusals`] says so (none at
/// first).
pub async fn start_refusing_cache(cache: SocketAddr) -> Result<(Service, Refusals), Error> {
    let refusals = Refusals::default();
    let tap = CacheTap {
        inner: crate::cache_client(cache).await?,
        log: Log::default(),
        held: Arc::default(),
        refusals: refusals.clone(),
    };
    let service = serve_tap("refusing cache", CacheServiceServer::new(tap)).await?;
    Ok((service, refusals))
}

/// The test's handle on a gated worker (see [`start_gate`]).
#[derive(Debug, Clone)]
pub struct Gate {
    open: Arc<watch::Sender<bool>>,
    waiting: watch::Receiver<usize>,
}

impl Gate {
    /// Forward passes that arrive from now on wait.
    pub fn close(&self) {
        self.open.send_replace(false);
    }

    /// Lets every waiting and later forward pass through.
    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Waits until at least one forward pass is held at the closed gate.
    pub async fn holding(&self) {
        let mut waiting = self.waiting.clone();
        let _ = waiting.wait_for(|n| *n > 0).await;
    }
}

/// The proxy's side of a [`Gate`].
#[derive(Debug, Clone)]
struct GateSide {
    open: watch::Receiver<bool>,
    waiting: Arc<watch::Sender<usize>>,
}

impl GateSide {
    async fn pass(&self) {
        let mut open = self.open.clone();
        if !*open.borrow_and_update() {
            self.waiting.send_modify(|n| *n += 1);
            let _ = open.wait_for(|o| *o).await;
            self.waiting.send_modify(|n| *n -= 1);
        }
    }
}

/// Starts a pass-through proxy in front of `worker` whose forward passes
/// wait while the returned [`Gate`] is closed (it starts open).
pub async fn start_gate(worker: SocketAddr) -> Result<(Service, Gate), Error> {
    let (open_tx, open_rx) = watch::channel(true);
    let (waiting_tx, waiting_rx) = watch::channel(0);
    let proxy = WorkerTap {
        inner: crate::worker_client(worker).await?,
        log: Log::default(),
        delay: Duration::ZERO,
        gate: Some(GateSide {
            open: open_rx,
            waiting: Arc::new(waiting_tx),
        }),
        failures: Arc::default(),
        pull_cuts: Arc::default(),
    };
    let service = serve_worker_tap("worker gate", proxy).await?;
    let gate = Gate {
        open: Arc::new(open_tx),
        waiting: waiting_rx,
    };
    Ok((service, gate))
}

/// The test's handle on a faulty worker (see [`start_faulty`]).
#[derive(Debug, Clone)]
pub struct Faults {
    forwards: Arc<AtomicU64>,
    pulls: Arc<AtomicU64>,
}

impl Faults {
    /// The next `n` forward passes fail (UNAVAILABLE) without reaching the
    /// worker, as a worker that died mid-pass.
    pub fn fail_next(&self, n: u64) {
        self.forwards.store(n, Ordering::Release);
    }

    /// Injected failures not yet spent.
    pub fn left(&self) -> u64 {
        self.forwards.load(Ordering::Acquire)
    }

    /// The next `n` peer pulls from this worker end (UNAVAILABLE) after
    /// their first chunk, as a source worker that died mid-pull.
    pub fn cut_next_pulls(&self, n: u64) {
        self.pulls.store(n, Ordering::Release);
    }

    /// Injected pull cuts not yet spent.
    pub fn pull_cuts_left(&self) -> u64 {
        self.pulls.load(Ordering::Acquire)
    }
}

/// Starts a pass-through proxy in front of `worker` whose forward passes
/// fail while the returned [`Faults`] says so (none at first).
pub async fn start_faulty(worker: SocketAddr) -> Result<(Service, Faults), Error> {
    let faults = Faults {
        forwards: Arc::default(),
        pulls: Arc::default(),
    };
    let proxy = WorkerTap {
        inner: crate::worker_client(worker).await?,
        log: Log::default(),
        delay: Duration::ZERO,
        gate: None,
        failures: faults.forwards.clone(),
        pull_cuts: faults.pulls.clone(),
    };
    let service = serve_worker_tap("faulty worker", proxy).await?;
    Ok((service, faults))
}

async fn serve_worker_tap(name: &'static str, tap: WorkerTap) -> Result<Service, Error> {
    serve_tap(
        name,
        WorkerServiceServer::new(tap)
            .max_encoding_message_size(kvlease_tokenizer::MAX_MESSAGE_BYTES),
    )
    .await
}

/// Serves one tap on `127.0.0.1:0`, as every kvlease server is served.
async fn serve_tap<S>(name: &'static str, tap: S) -> Result<Service, Error>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let listeners = Listeners::bind(SocketAddr::from(([127, 0, 0, 1], 0)), None).await?;
    let info = ServerInfo {
        name,
        descriptors: kvlease_proto::FILE_DESCRIPTOR_SET,
    };
    Ok(Service::start(
        name,
        name,
        listeners,
        READY_WITHIN,
        &kvlease_auth::SecurityArgs::default(),
        |l, stop| async move {
            serve(
                info,
                l,
                &kvlease_auth::Security::loopback(),
                &Default::default(),
                tap,
                String::new,
                stop,
            )
            .await
            .map_err(|e| kvlease::Error::Service {
                service: name,
                message: e.to_string(),
            })
        },
    )
    .await?)
}
