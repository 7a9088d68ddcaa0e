//! The host-memory tier on the CPU backend (the scenarios live in `tiers`,
//! shared with the GPU tests of `cuda.rs`): a demoted block survives its
//! device block being rewritten, and onboarding it back gives K/V
//! bit-identical to recomputing it (same logits, through prefill and a
//! decode step); the slot ledger follows the copies; malformed copies and
//! a worker without a tier are refused; blocks pulled from another worker
//! (a peer pull's read and write) equal recomputing them.

// Only the fixed model and table helpers of the shared scenarios are used here.
#[allow(dead_code)]
mod common;
mod tiers;

use common::fixed_model;
use tiers::tier_copies as copies;
use worker_svc::Error;
use worker_svc::batch::{TierCopyInput, TierDirection};
use worker_svc::model::weights::Weights;
use worker_svc::worker::{Worker, WorkerOptions};

fn tiered_worker(weights: &Weights, host_blocks: u32) -> Worker {
    let options = WorkerOptions {
        host_blocks,
        ..common::options()
    };
    Worker::new_cpu(weights.clone(), options).unwrap_or_else(|e| panic!("worker: {e}"))
}

#[test]
fn onboarded_kv_is_bit_identical_to_recomputed_kv() {
    tiers::onboarded_kv_is_bit_identical(&tiered_worker);
}

#[test]
fn kv_pulled_from_another_worker_is_bit_identical_to_recomputed_kv() {
    tiers::pulled_kv_is_bit_identical(&|w: &Weights| tiered_worker(w, 0));
}

#[test]
fn a_forward_of_copies_only_runs_them_and_answers_no_results() {
    tiers::copies_only_forward(&tiered_worker);
}

#[test]
fn malformed_tier_copies_are_refused_and_copy_nothing() {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = tiered_worker(&weights, 4);
    let bad_host = copies(TierDirection::Demote, &[(1, 4)]);
    match worker.apply_tier_copies(&bad_host) {
        Err(Error::InvalidTierCopy { index: 0, message }) => {
            assert!(message.contains("host_block 4"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let bad_window = [TierCopyInput {
        window: 7,
        direction: TierDirection::Onboard,
        device_block: 0,
        host_block: 0,
        disk: Default::default(),
    }];
    assert!(matches!(
        worker.apply_tier_copies(&bad_window),
        Err(Error::InvalidTierCopy { .. })
    ));

    let mut no_tier = tiered_worker(&weights, 0);
    match no_tier.apply_tier_copies(&copies(TierDirection::Demote, &[(1, 0)])) {
        Err(Error::InvalidTierCopy { message, .. }) => {
            assert!(message.contains("no host tier"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}
