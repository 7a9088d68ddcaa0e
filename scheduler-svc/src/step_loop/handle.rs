//! The service's side of the step loop: submitting requests (refused past
//! the queue limit) and reading the loop's status.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::sync::{mpsc, watch};

use crate::domain::{Output, RequestId};
use crate::error::{Error, Result};
use crate::queue::Request;
use crate::step::Counters;

/// A request handed to the loop, with the stream its outputs go to and the
/// span of its `Generate` call (the root of the request's trace: the loop
/// adds its spans under it, see `traces.rs`).
#[derive(Debug)]
pub(crate) struct Submission {
    pub request: Request,
    pub events: mpsc::UnboundedSender<Output>,
    /// Samples whose output the client no longer reads (their text ended
    /// at a stop string): the loop ends them (`Core::end_branch`).
    pub ended: mpsc::UnboundedReceiver<u32>,
    pub trace: tracing::Span,
}

/// What `GetStatus` shows of the loop.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StatusSnapshot {
    pub queued: u32,
    pub running: u32,
    pub preempted: u32,
    pub steps: u64,
    pub session_id: u64,
    pub epoch: u64,
    pub counters: Counters,
}

/// The service side of the loop: submit requests, read the status.
#[derive(Debug, Clone)]
pub(crate) struct StepLoopHandle {
    submit: mpsc::UnboundedSender<Submission>,
    status: watch::Receiver<StatusSnapshot>,
    next_id: Arc<AtomicU64>,
    /// Submissions the loop has not taken in yet.
    backlog: Arc<AtomicUsize>,
    /// Most requests waiting (0: no limit).
    max_queue: usize,
}

impl StepLoopHandle {
    /// The handle of a loop taking submissions from `submit`'s receiver and
    /// publishing on `status`'s sender; `backlog` counts what it has not
    /// taken in yet.
    pub(super) fn new(
        submit: mpsc::UnboundedSender<Submission>,
        status: watch::Receiver<StatusSnapshot>,
        backlog: Arc<AtomicUsize>,
        max_queue: usize,
    ) -> Self {
        Self {
            submit,
            status,
            next_id: Arc::new(AtomicU64::new(1)),
            backlog,
            max_queue,
        }
    }

    /// A fresh request id (also its arrival order).
    pub(crate) fn next_request_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Hands a request to the loop; its outputs arrive on the receiver, the
    /// last one being `Output::Finished`. Dropping the receiver cancels it.
    pub(crate) fn submit(
        &self,
        request: Request,
        trace: tracing::Span,
    ) -> Result<(mpsc::UnboundedReceiver<Output>, mpsc::UnboundedSender<u32>)> {
        let queued = self.status().queued as usize;
        if self.max_queue > 0 && queued >= self.max_queue {
            return Err(Error::QueueFull {
                queued,
                limit: self.max_queue,
            });
        }
        let (events, rx) = mpsc::unbounded_channel();
        let (end, ended) = mpsc::unbounded_channel();
        self.backlog.fetch_add(1, Ordering::AcqRel);
        self.submit
            .send(Submission {
                request,
                events,
                ended,
                trace,
            })
            .map_err(|_| {
                self.backlog.fetch_sub(1, Ordering::AcqRel);
                Error::ShuttingDown
            })?;
        Ok((rx, end))
    }

    /// The loop's last snapshot, its queue counting the submissions the
    /// loop has not taken in yet (a loop waiting on a forward pass takes
    /// none, and its snapshot is as old as the pass).
    pub(crate) fn status(&self) -> StatusSnapshot {
        let mut s = self.status.borrow().clone();
        let backlog = u32::try_from(self.backlog.load(Ordering::Acquire)).unwrap_or(u32::MAX);
        s.queued = s.queued.saturating_add(backlog);
        s
    }
}
