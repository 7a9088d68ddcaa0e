//! The disk tier on the CPU backend: a prefix spilled from the host tier
//! to block files and loaded back into other device blocks gives logits
//! bit-identical to recomputing it, also in a new worker over the same
//! directory; a corrupted, missing or foreign file is a miss (the request
//! fails whole, nothing of it applied), never K/V.

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod tiers;

use std::path::Path;

use common::fixed_model;
use tiers::disk::{self, DISK_BYTES, disk_copies, temp_dir};
use worker_svc::Error;
use worker_svc::batch::TierDirection;
use worker_svc::model::weights::Weights;
use worker_svc::worker::{Worker, WorkerOptions};

fn disk_worker(weights: &Weights, dir: &Path, identity: &str) -> Worker {
    let options = WorkerOptions {
        host_blocks: 8,
        ..common::options()
    };
    let mut worker =
        Worker::new_cpu(weights.clone(), options).unwrap_or_else(|e| panic!("worker: {e}"));
    worker
        .open_disk_tier(dir, DISK_BYTES, identity)
        .unwrap_or_else(|e| panic!("disk tier: {e}"));
    worker
}

#[test]
fn loaded_kv_is_bit_identical_to_recomputed_kv_also_after_a_restart() {
    disk::loaded_kv_is_bit_identical_also_after_a_restart(&disk_worker);
}

#[test]
fn a_corrupted_file_fails_the_request_whole_and_is_gone() {
    disk::a_corrupted_file_fails_the_request_whole_and_is_gone(&disk_worker);
}

#[test]
fn malformed_disk_copies_are_refused() {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let options = WorkerOptions {
        host_blocks: 8,
        ..common::options()
    };
    let mut no_disk = Worker::new_cpu(weights.clone(), options).unwrap();
    match no_disk.apply_tier_copies(&disk_copies(TierDirection::Load, &[(1, 0)])) {
        Err(Error::InvalidTierCopy { message, .. }) => {
            assert!(message.contains("no disk tier"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let dir = temp_dir("malformed");
    let mut worker = disk_worker(&weights, &dir, "fixed");
    let blocks = worker.info().pools[0].disk_blocks;
    match worker.apply_tier_copies(&disk_copies(TierDirection::Spill, &[(1, blocks)])) {
        Err(Error::InvalidTierCopy { message, .. }) => {
            assert!(
                message.contains(&format!("disk_block {blocks}")),
                "{message}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    match worker.apply_tier_copies(&disk_copies(TierDirection::Spill, &[(8, 0)])) {
        Err(Error::InvalidTierCopy { message, .. }) => {
            assert!(message.contains("host_block 8"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_disk_tier_needs_a_host_tier() {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = Worker::new_cpu(weights, common::options()).unwrap();
    let dir = temp_dir("nohost");
    let err = worker.open_disk_tier(&dir, DISK_BYTES, "x").unwrap_err();
    assert!(err.to_string().contains("--host-blocks"), "{err}");
}
