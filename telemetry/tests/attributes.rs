//! Rejects are error spans with figures and an event; a fenced release links to the
//! CompleteStep that frees it; background work is attributed to its logical service.

mod common;

use common::{TestResult, attr, attr_str, capture};
use kvlease_telemetry::attributes::{
    self, BLOCKS_FREE, BLOCKS_NEEDED, BLOCKS_PENDING_FREE, LINK_FENCED_RELEASE, LINK_KIND, POOL_ID,
    REJECT_EVENT, REJECT_REASON, SEQ_ID, WINDOW,
};
use kvlease_telemetry::opentelemetry::Value;
use kvlease_telemetry::opentelemetry::trace::{SpanId, Status};
use kvlease_telemetry::{RejectFigures, add_link, in_service, reject_span, span_context};

const FIGURES: RejectFigures<'static> = RejectFigures {
    seq_id: 42,
    reason: "POOL_EXHAUSTED",
    pool_id: 1,
    window: 4096,
    blocks_needed: 9,
    blocks_free: 2,
    blocks_pending_free: 3,
    message: "pool 1 has 2 free blocks, 9 needed",
};

#[test]
fn a_reject_is_an_error_span_with_figures_and_an_event() -> TestResult {
    let capture = capture("kvlease-cache")?;
    let lease = tracing::info_span!("lease");
    let lease_cx = span_context(&lease);
    lease.in_scope(|| drop(reject_span(&FIGURES)));
    drop(lease);

    let reject = capture
        .span(attributes::REJECT_SPAN)
        .ok_or("no reject span")?;
    assert_eq!(
        reject.parent_span_id,
        lease_cx.span_id(),
        "reject is a child of the call"
    );
    assert_eq!(reject.span_context.trace_id(), lease_cx.trace_id());
    assert_eq!(
        reject.status,
        Status::error("pool 1 has 2 free blocks, 9 needed"),
        "error status with the message"
    );
    assert_eq!(attr(&reject, SEQ_ID), Some(Value::I64(42)));
    assert_eq!(
        attr_str(&reject, REJECT_REASON).as_deref(),
        Some("POOL_EXHAUSTED")
    );
    assert_eq!(attr(&reject, POOL_ID), Some(Value::I64(1)));
    assert_eq!(attr(&reject, WINDOW), Some(Value::I64(4096)));
    assert_eq!(attr(&reject, BLOCKS_NEEDED), Some(Value::I64(9)));
    assert_eq!(attr(&reject, BLOCKS_FREE), Some(Value::I64(2)));
    assert_eq!(attr(&reject, BLOCKS_PENDING_FREE), Some(Value::I64(3)));

    let event = reject
        .events
        .iter()
        .find(|e| e.name == REJECT_EVENT)
        .ok_or("no reject event")?;
    let reason = event
        .attributes
        .iter()
        .find(|kv| kv.key.as_str() == REJECT_REASON);
    assert_eq!(
        reason.map(|kv| kv.value.as_str().into_owned()).as_deref(),
        Some("POOL_EXHAUSTED")
    );

    // The enclosing call itself stays OK: a reject is data, not a failed call.
    let lease = capture.span("lease").ok_or("no lease span")?;
    assert_eq!(lease.status, Status::Unset);
    Ok(())
}

#[test]
fn a_fenced_release_is_linked_from_the_complete_step_that_frees_it() -> TestResult {
    let capture = capture("kvlease-cache")?;
    // The release span ends first; its context is kept with the fence.
    let release = tracing::info_span!("release", kvlease.fence_step = 7_i64);
    let fenced = span_context(&release);
    drop(release);

    let complete = tracing::info_span!("complete_step");
    attributes::set_u64(&complete, attributes::STEP, 7);
    add_link(&complete, fenced.clone(), LINK_FENCED_RELEASE);
    drop(complete);

    let complete = capture
        .span("complete_step")
        .ok_or("no complete_step span")?;
    let link = complete.links.iter().next().ok_or("no link")?;
    assert_eq!(link.span_context.span_id(), fenced.span_id());
    assert_eq!(link.span_context.trace_id(), fenced.trace_id());
    let kind = link
        .attributes
        .iter()
        .find(|kv| kv.key.as_str() == LINK_KIND);
    assert_eq!(
        kind.map(|kv| kv.value.as_str().into_owned()).as_deref(),
        Some("fenced_release")
    );

    let release = capture.span("release").ok_or("no release span")?;
    assert_eq!(attr(&release, attributes::FENCE_STEP), Some(Value::I64(7)));
    assert_eq!(attr(&complete, attributes::STEP), Some(Value::I64(7)));
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn background_work_is_attributed_to_its_logical_service() -> TestResult {
    let capture = capture("kvlease-process")?;
    let outer = tracing::info_span!("spawner");
    let _entered = outer.enter();
    in_service("kvlease-scheduler", async {
        let step = tracing::info_span!("step");
        let _step = step.enter();
        tracing::info_span!("step.lease").in_scope(|| {});
    })
    .await;
    drop(_entered);
    drop(outer);

    let step = capture.span("step").ok_or("no step span")?;
    assert_eq!(
        attr_str(&step, attributes::SERVICE).as_deref(),
        Some("kvlease-scheduler")
    );
    let lease = capture.span("step.lease").ok_or("no step.lease span")?;
    assert_eq!(
        attr_str(&lease, attributes::SERVICE).as_deref(),
        Some("kvlease-scheduler")
    );
    assert_eq!(lease.parent_span_id, step.span_context.span_id());
    let outer = capture.span("spawner").ok_or("no spawner span")?;
    assert_eq!(
        attr_str(&outer, attributes::SERVICE).as_deref(),
        Some("kvlease-process")
    );
    assert_eq!(
        step.parent_span_id,
        SpanId::INVALID,
        "a background task's span is a root"
    );
    Ok(())
}
