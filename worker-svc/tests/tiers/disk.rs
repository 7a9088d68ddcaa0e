//! The disk-tier scenarios shared by `disk_tier.rs` (CPU backend) and
//! `cuda.rs` (the GPU backend, whose host tier is pinned memory): a prefix
//! spilled from the host tier to block files and loaded back into other
//! device blocks gives logits bit-identical to recomputing it, also in a new
//! worker over the same directory; a corrupted file is a miss (the request
//! fails whole, nothing of it applied), never K/V.

use std::path::{Path, PathBuf};

use worker_svc::Error;
use worker_svc::batch::{DiskRef, TierCopyInput, TierDirection};
use worker_svc::model::weights::Weights;
use worker_svc::worker::Worker;

use super::tier_copies;
use crate::common::{assert_bit_identical, fixed_model, run_one, seq_input, table};

/// Builds the worker under test for some weights with a host tier of 8
/// blocks per pool and a disk tier of [`DISK_BYTES`] in a directory, under
/// a model identity (files of another identity are not its own).
pub(crate) type DiskBuild<'a> = &'a dyn Fn(&Weights, &Path, &str) -> Worker;

pub(crate) const DISK_BYTES: u64 = 1 << 24;

pub(crate) fn temp_dir(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "kvlease-disk-{name}-{}-{nanos}",
        std::process::id()
    ))
}

/// Disk copies of one direction in both pools: `(block, disk block)` pairs
/// (host blocks for a spill, device blocks for a load), each with the hash
/// `1000 + disk block`.
pub(crate) fn disk_copies(direction: TierDirection, pairs: &[(u32, u32)]) -> Vec<TierCopyInput> {
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

fn io<T>(result: std::io::Result<T>, what: &str) -> T {
    result.unwrap_or_else(|e| panic!("{what}: {e}"))
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

pub(crate) fn loaded_kv_is_bit_identical_also_after_a_restart(build: DiskBuild<'_>) {
    let dir = temp_dir("roundtrip");
    let weights = fixed_model(vec![0, 32, 0], 4);
    let vocab = weights.config.vocab_size;
    let mut worker = build(&weights, &dir, "fixed");
    assert!(worker.info().pools.iter().all(|p| p.disk_blocks > 0));
    prefix_on_disk(&mut worker);
    let loaded = loaded_logits(&mut worker);
    let recomputed = recomputed_logits(&mut worker, vocab);
    assert_bit_identical(&loaded, &recomputed, "loaded vs recomputed");
    let first = worker.info().incarnation;
    drop(worker);

    // A new worker over the same directory announces the three files of
    // each pool and loads them back alike.
    let mut restarted = build(&weights, &dir, "fixed");
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
    io(std::fs::remove_dir_all(&dir), "remove the tier");
}

pub(crate) fn a_corrupted_file_fails_the_request_whole_and_is_gone(build: DiskBuild<'_>) {
    let dir = temp_dir("corrupt");
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = build(&weights, &dir, "fixed");
    prefix_on_disk(&mut worker);
    let file = dir.join("w32").join("1.kvb");
    let mut bytes = io(std::fs::read(&file), "read a block file");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    io(std::fs::write(&file, bytes), "corrupt a block file");
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
            .forward(vec![seq_input(2, &suffix, 12, both(&[40, 41, 42, 43]))])
            .is_err()
    );
    // Files of another model are not announced (and deleted at start).
    let other = build(&weights, &dir, "another model");
    assert!(other.info().pools.iter().all(|p| p.disk_held.is_empty()));
    io(std::fs::remove_dir_all(&dir), "remove the tier");
}
