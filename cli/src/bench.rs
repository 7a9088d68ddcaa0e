//! The load driver: sends a workload's requests through the scheduler's
//! `Generate` with bounded concurrency, at a fixed rate or at the trace's
//! arrival times, and records how each one ended.

use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Channel;

use crate::workload::Request;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// `max_tokens` reached.
    Length,
    /// A stop token.
    Stop,
    /// The cache could not supply blocks: its reason (`POOL_EXHAUSTED`, ...).
    Rejected(String),
    /// `CANCELLED`, with the scheduler's message.
    Cancelled(String),
    /// `ERROR` (a worker failed), with the scheduler's message.
    Error(String),
    /// The call itself failed (status code and message), or timed out.
    Failed(String),
}

impl Finish {
    /// Whether the request produced its completion.
    pub fn is_ok(&self) -> bool {
        matches!(self, Self::Length | Self::Stop)
    }
}

/// One request's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub index: usize,
    /// From sending the call to the end of its stream.
    pub latency: Duration,
    /// From sending the call to the first generated token.
    pub ttft: Option<Duration>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Prompt tokens served from cached prefix blocks.
    pub reused_tokens: u32,
    pub preemptions: u32,
    pub finish: Finish,
}

/// How to drive the load.
#[derive(Debug, Clone)]
pub struct Load {
    /// Requests in flight at most.
    pub concurrency: usize,
    /// Requests per second; `None` = as fast as concurrency allows (or at
    /// the requests' own arrival times when they have them).
    pub rate: Option<f64>,
    /// Bound on one request, stream included.
    pub timeout: Duration,
    /// Show a progress bar on stderr (hidden anyway when it is no terminal).
    pub progress: bool,
    /// Parallel samples per request (`GenerateRequest.n`); more than one
    /// samples at temperature 1, seeded with the request's index.
    pub samples: u32,
    /// Beam search of this width per request (`GenerateRequest.beam_width`;
    /// 1: off), answering `samples` hypotheses.
    pub beam_width: u32,
}

impl Default for Load {
    fn default() -> Self {
        Self {
            concurrency: 16,
            rate: None,
            timeout: Duration::from_secs(300),
            progress: true,
            samples: 1,
            beam_width: 1,
        }
    }
}

/// Sends `requests` and returns their outcomes in workload order.
pub async fn drive(
    client: SchedulerClient<Channel>,
    requests: Vec<Request>,
    load: &Load,
) -> Vec<Outcome> {
    let bar = progress_bar(requests.len() as u64, load.progress);
    let slots = Arc::new(Semaphore::new(load.concurrency.max(1)));
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    let mut counts = Counts::default();
    let mut outcomes = Vec::with_capacity(requests.len());
    for (i, request) in requests.into_iter().enumerate() {
        let due = match (load.rate, request.at) {
            (Some(rate), _) if rate > 0.0 => Some(Duration::from_secs_f64(i as f64 / rate)),
            (_, at) => at,
        };
        if let Some(due) = due {
            // record what finished while waiting, so the bar keeps moving
            let sleep = tokio::time::sleep_until(start + due);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    () = &mut sleep => break,
                    Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                        record(done, &mut outcomes, &mut counts, &bar);
                    }
                }
            }
        }
        let permit = loop {
            tokio::select! {
                permit = slots.clone().acquire_owned() => break permit,
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    record(done, &mut outcomes, &mut counts, &bar);
                }
            }
        };
        let Ok(permit) = permit else { break };
        let client = client.clone();
        let timeout = load.timeout;
        let (samples, beam_width) = (load.samples, load.beam_width);
        tasks.spawn(async move {
            let outcome = generate(client, request, timeout, samples, beam_width).await;
            drop(permit);
            outcome
        });
    }
    while let Some(done) = tasks.join_next().await {
        record(done, &mut outcomes, &mut counts, &bar);
    }
    bar.finish_with_message(counts.message());
    outcomes.sort_by_key(|o| o.index);
    outcomes
}

fn progress_bar(len: u64, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}) {msg}",
    ) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

#[derive(Debug, Default)]
struct Counts {
    ok: u64,
    rejected: u64,
    other: u64,
}

impl Counts {
    fn message(&self) -> String {
        format!(
            "ok {} rejected {} failed {}",
            self.ok, self.rejected, self.other
        )
    }
}

fn record(
    done: std::result::Result<Outcome, tokio::task::JoinError>,
    outcomes: &mut Vec<Outcome>,
    counts: &mut Counts,
    bar: &ProgressBar,
) {
    match done {
        Ok(o) => {
            match o.finish {
                Finish::Length | Finish::Stop => counts.ok += 1,
                Finish::Rejected(_) => counts.rejected += 1,
                _ => counts.other += 1,
            }
            outcomes.push(o);
        }
        // a panicked request task: counted as failed, the rest go on
        Err(e) => {
            counts.other += 1;
            tracing::warn!(error = %e, "request task failed");
        }
    }
    bar.inc(1);
    bar.set_message(counts.message());
}

/// Sends one request of `samples` samples (hypotheses of a beam search
/// of `beam_width`, when over 1) and reads its stream to the end: output
/// tokens of every sample, the finish of the first sample that did not
/// complete, else the last one's.
pub async fn generate(
    mut client: SchedulerClient<Channel>,
    request: Request,
    timeout: Duration,
    samples: u32,
    beam_width: u32,
) -> Outcome {
    let sent = Instant::now();
    let mut outcome = Outcome {
        index: request.index,
        latency: Duration::ZERO,
        ttft: None,
        prompt_tokens: request.tokens.len() as u32,
        output_tokens: 0,
        reused_tokens: 0,
        preemptions: 0,
        finish: Finish::Failed("no finish reason".into()),
    };
    let call = pb::GenerateRequest {
        tokens: request.tokens,
        max_tokens: request.max_tokens,
        request_id: format!("bench-{}", request.index),
        // a workload's output lengths are part of it: no early end of sequence
        ignore_eos: true,
        n: samples,
        beam_width,
        // samples of one greedy prompt would all be the same; beams rank
        // the raw distribution
        temperature: if samples > 1 && beam_width <= 1 {
            1.0
        } else {
            0.0
        },
        seed: request.index as u64,
        ..Default::default()
    };
    let run = async {
        let mut stream = client.generate(call).await?.into_inner();
        let mut first = true;
        let mut ended = 0;
        while let Some(msg) = stream.message().await? {
            if first {
                outcome.reused_tokens = msg.reused_tokens;
                first = false;
            }
            if !msg.tokens.is_empty() && outcome.ttft.is_none() {
                outcome.ttft = Some(sent.elapsed());
            }
            outcome.output_tokens += msg.tokens.len() as u32;
            if msg.finish_reason != 0 {
                outcome.preemptions = outcome.preemptions.max(msg.preemptions);
                if ended == 0 || outcome.finish.is_ok() {
                    outcome.finish = finish_of(&msg);
                }
                ended += 1;
            }
        }
        Ok::<(), tonic::Status>(())
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(Ok(())) => {}
        Ok(Err(status)) => {
            outcome.finish = Finish::Failed(format!("{:?}: {}", status.code(), status.message()));
        }
        Err(_) => outcome.finish = Finish::Failed(format!("timed out after {timeout:?}")),
    }
    outcome.latency = sent.elapsed();
    outcome
}

/// The finish of a stream's last message.
pub fn finish_of(msg: &pb::GenerateResponse) -> Finish {
    use pb::FinishReason as F;
    match F::try_from(msg.finish_reason).unwrap_or(F::Unspecified) {
        F::Length => Finish::Length,
        F::Stop => Finish::Stop,
        F::Rejected => Finish::Rejected(
            msg.reject
                .as_ref()
                .and_then(|r| pb::RejectReason::try_from(r.reason).ok())
                .map_or_else(
                    || "UNSPECIFIED".to_string(),
                    |r| r.as_str_name().to_string(),
                ),
        ),
        F::Cancelled => Finish::Cancelled(msg.message.clone()),
        F::Error => Finish::Error(msg.message.clone()),
        F::Unspecified => Finish::Failed(format!("unknown finish reason {}", msg.finish_reason)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_map_with_the_reject_reason() {
        let mut msg = pb::GenerateResponse {
            finish_reason: pb::FinishReason::Rejected as i32,
            reject: Some(pb::Reject {
                reason: pb::RejectReason::PoolExhausted as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(finish_of(&msg), Finish::Rejected("POOL_EXHAUSTED".into()));
        msg.reject = None;
        assert_eq!(finish_of(&msg), Finish::Rejected("UNSPECIFIED".into()));
        msg.finish_reason = pb::FinishReason::Error as i32;
        msg.message = "worker gone".into();
        assert_eq!(finish_of(&msg), Finish::Error("worker gone".into()));
        msg.finish_reason = pb::FinishReason::Length as i32;
        assert!(finish_of(&msg).is_ok());
    }
}
