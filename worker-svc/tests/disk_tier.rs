//! The disk tier on the CPU backend: a prefix spilled from the host tier
//! to block files and loaded back into other device blocks gives logits
//! bit-identical to recomputing it, also in a new worker over the same
//! directory; a corrupted, missing or foreign file is a miss (the request
//! fails whole, nothing of it applied), never K/V.

#[allow(dead_code)]
mod common;
#[allow(dead_code)]
mod tiers;

use std::path::{Path, PathBuf};

use common::{assert_bit_identical, fixed_model, run_one, table};
use tiers::tier_copies;
use worker_svc::Error;
use worker_svc::batch::{DiskRef, TierCopyInput, TierDirection};
use worker_svc::model::weights::Weights;
use worker_svc::worker::{Worker, WorkerOptions};

const DISK_BYTES: u64 = 1 << 24;

fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "kvlease-disk-{name}-{}-{nanos}",
        std::process::id()
    ))
}

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

/// Disk copies of one direction in both pools: `(block, disk block)` pairs
/// (host blocks for a spill, device blocks for a load), each with the hash
/// `1000 + disk block`.
fn disk_copies(direction: TierDirection, pairs: &[(u32, u32)]) -> Vec<TierCopyInput> {
    [0, 32]
        .into_iter()
        .flat_map(|window| {
            pairs.iter().map(move |&(block, disk)| TierCopyInput {
                window,
                direction,
                device_block: block,
                host_block: block,
                disk: DiskRef {
                    block: disk,
                    hash: 1000 + u64::from(disk),
                    parent: 0,
                },
            })
        })
        .collect()
}

fn apply(worker: &mut Worker, copies: &[TierCopyInput], what: &str) {
    if let Err(e) = worker.apply_tier_copies(copies) {
        panic!("{what}: {e}");
    }
}

fn both(ids: &[u32]) -> Vec<worker_svc::batch::TableInput> {
    vec![table(0, 0, ids), table(32, 0, ids)]
}

fn prefix() -> Vec<u32> {
    (0..12).map(|i| (i * 7 + 3) % 64).collect()
}

/// Writes the prefix in device blocks 10-12, demotes them to host blocks
/// 5-7 and spills those to disk blocks 0-2; then overwrites the device and
/// host blocks, so only the files hold the prefix.
fn prefix_on_disk(worker: &mut Worker) {
    let a: Vec<u32> = prefix().iter().chain(&[2, 4]).copied().collect();
    run_one(worker, 1, &a, 0, both(&[10, 11, 12, 13]));
    apply(
        worker,
        &tier_copies(TierDirection::Demote, &[(10, 5), (11, 6), (12, 7)]),
        "demote",
    );
    apply(
        worker,
        &disk_copies(TierDirection::Spill, &[(5, 0), (6, 1), (7, 2)]),
        "spill",
    );
    let other: Vec<u32> = (0..12).map(|i| (i * 11 + 1) % 64).collect();
    run_one(worker, 9, &other, 0, both(&[10, 11, 12]));
    apply(
        worker,
        &tier_copies(TierDirection::Demote, &[(10, 5), (11, 6), (12, 7)]),
        "demote over the host blocks",
    );
}

/// Loads the prefix into device blocks 40-42, computes the suffix and a
/// decode step; returns their logits.
fn loaded_logits(worker: &mut Worker) -> Vec<f32> {
    let suffix: Vec<u32> = vec![5, 9, 33, 1, 60];
    let tables = || both(&[40, 41, 42, 43, 44]);
    apply(
        worker,
        &disk_copies(TierDirection::Load, &[(40, 0), (41, 1), (42, 2)]),
        "load",
    );
    let mut out = run_one(worker, 2, &suffix, 12, tables());
    out.extend(run_one(worker, 2, &[42], 17, tables()));
    out
}

fn recomputed_logits(worker: &mut Worker, vocab: usize) -> Vec<f32> {
    let full: Vec<u32> = prefix().iter().chain(&[5, 9, 33, 1, 60]).copied().collect();
    let tables = || both(&[30, 31, 32, 33, 34]);
    let all = run_one(worker, 3, &full, 0, tables());
    let mut out = all[12 * vocab..].to_vec();
    out.extend(run_one(worker, 3, &[42], 17, tables()));
    out
}

#[test]
fn loaded_kv_is_bit_identical_to_recomputed_kv_also_after_a_restart() {
    let dir = temp_dir("roundtrip");
    let weights = fixed_model(vec![0, 32, 0], 4);
    let vocab = weights.config.vocab_size;
    let mut worker = disk_worker(&weights, &dir, "fixed");
    assert!(worker.info().pools.iter().all(|p| p.disk_blocks > 0));
    prefix_on_disk(&mut worker);
    let loaded = loaded_logits(&mut worker);
    let recomputed = recomputed_logits(&mut worker, vocab);
    assert_bit_identical(&loaded, &recomputed, "loaded vs recomputed");
    let first = worker.info().incarnation;
    drop(worker);

    // A new worker over the same directory announces the three files of
    // each pool and loads them back alike.
    let mut restarted = disk_worker(&weights, &dir, "fixed");
    assert_ne!(restarted.info().incarnation, first);
    for p in &restarted.info().pools {
        let held: Vec<(u32, u64)> = p.disk_held.iter().map(|h| (h.block, h.hash)).collect();
        assert_eq!(
            held,
            [(0, 1000), (1, 1001), (2, 1002)],
            "window {}",
            p.window
        );
    }
    let again = loaded_logits(&mut restarted);
    assert_bit_identical(&again, &recomputed, "loaded after a restart vs recomputed");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_corrupted_file_fails_the_request_whole_and_is_gone() {
    let dir = temp_dir("corrupt");
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = disk_worker(&weights, &dir, "fixed");
    prefix_on_disk(&mut worker);
    let file = dir.join("w32").join("1.kvb");
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    // A request with a demotion, then loads: the bad file refuses it all.
    let mut copies = tier_copies(TierDirection::Demote, &[(13, 0)]);
    copies.extend(disk_copies(
        TierDirection::Load,
        &[(40, 0), (41, 1), (42, 2)],
    ));
    match worker.apply_tier_copies(&copies) {
        Err(Error::DiskBlock(message)) => {
            assert!(message.contains("disk block 1 of window 32"), "{message}");
            assert!(message.contains("checksum"), "{message}");
        }
        other => panic!("expected a disk-block miss, got {other:?}"),
    }
    assert!(!file.exists(), "the bad file is deleted");
    // Nothing was loaded: a pass over block 40 is refused (unwritten).
    let suffix: Vec<u32> = vec![5, 9];
    assert!(
        worker
            .forward(vec![common::seq_input(
                2,
                &suffix,
                12,
                both(&[40, 41, 42, 43])
            )])
            .is_err()
    );
    // Files of another model are not announced (and deleted at start).
    let other = disk_worker(&weights, &dir, "another model");
    assert!(other.info().pools.iter().all(|p| p.disk_held.is_empty()));
    std::fs::remove_dir_all(&dir).unwrap();
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
