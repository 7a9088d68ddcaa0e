//! Outputs to the request streams, a batch per call from the loop's thread.
//!
//! Each request's stream is read by a task of the service's shared runtime.
//! A send into a stream's channel from the loop's thread wakes that task,
//! and a wake from outside the runtime pushes it onto the runtime's shared
//! queue and, when no worker thread is looking for work, wakes one with a
//! futex call. A decode step of 256 sequences made 256 such wakes on the
//! way from a forward pass's answer to the next launch: on two cores
//! (seeded model, `kvlease bench` at concurrency 256) they were 9% of the
//! loop thread's time, plus the time it lost to the threads it woke. Here
//! the loop hands a step's outputs to one task of the shared runtime in one
//! message (one wake), and that task sends them on, where a wake is a push
//! onto its own worker's queue.

use tokio::sync::mpsc;

use crate::domain::Output;
use crate::error::{Error, Result};

/// One output and the stream it goes to.
type Item = (mpsc::UnboundedSender<Output>, Output);

/// The loop's end: collects a step's outputs, then sends them on at once.
#[derive(Debug)]
pub(super) struct Delivery {
    batch: Vec<Item>,
    tx: mpsc::UnboundedSender<Vec<Item>>,
}

impl Delivery {
    /// A delivery whose task runs on the runtime of the calling context (the
    /// service's shared runtime); the task ends when the delivery is dropped
    /// and what it was handed is sent.
    pub(super) fn start() -> Result<Self> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| Error::StepThread(std::io::Error::other(e)))?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<Item>>();
        runtime.spawn(async move {
            while let Some(batch) = rx.recv().await {
                for (stream, output) in batch {
                    // a closed stream is reaped by the loop as a cancellation
                    let _ = stream.send(output);
                }
            }
        });
        Ok(Self {
            batch: Vec::new(),
            tx,
        })
    }

    /// `output` goes to `stream` with the next [`Self::flush`].
    pub(super) fn push(&mut self, stream: &mpsc::UnboundedSender<Output>, output: Output) {
        self.batch.push((stream.clone(), output));
    }

    /// Hands the collected outputs to the task, in the order they were pushed.
    pub(super) fn flush(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        // refused only once the shared runtime shut down, and with it the
        // request streams
        let _ = self.tx.send(std::mem::take(&mut self.batch));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::RequestId;

    fn tokens(request: u64, token: u32) -> Output {
        Output::Tokens {
            request: RequestId(request),
            index: 0,
            tokens: vec![token],
            reused_tokens: None,
            logprobs: Vec::new(),
            prompt_logprobs: None,
        }
    }

    fn token_of(output: Output) -> u32 {
        match output {
            Output::Tokens { tokens, .. } => tokens[0],
            other => panic!("not tokens: {other:?}"),
        }
    }

    #[tokio::test]
    async fn outputs_arrive_in_order_and_only_after_a_flush() {
        let mut delivery = Delivery::start().unwrap();
        let (a, mut a_rx) = mpsc::unbounded_channel();
        let (b, mut b_rx) = mpsc::unbounded_channel();
        delivery.push(&a, tokens(1, 10));
        delivery.push(&b, tokens(2, 20));
        delivery.push(&a, tokens(1, 11));
        tokio::task::yield_now().await;
        assert!(a_rx.try_recv().is_err(), "sent before the flush");
        delivery.flush();
        delivery.push(&a, tokens(1, 12));
        // the stream's own sender goes with its last output: the clone in
        // the batch keeps the channel open until that output is sent
        drop(a);
        delivery.flush();
        drop(delivery);
        let mut got = Vec::new();
        while let Some(o) = a_rx.recv().await {
            got.push(token_of(o));
        }
        assert_eq!(got, [10, 11, 12]);
        assert_eq!(b_rx.recv().await.map(token_of), Some(20));
    }

    #[test]
    fn outside_a_runtime_it_is_an_error_not_a_panic() {
        let err = Delivery::start().unwrap_err();
        assert!(matches!(err, Error::StepThread(_)), "{err}");
    }
}
