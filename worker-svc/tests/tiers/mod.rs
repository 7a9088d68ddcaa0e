//! The host-tier scenarios shared by `host_tier.rs` (CPU backend) and
//! `cuda.rs` (the pinned tier of the GPU backend). Each takes the backend as
//! a function building a worker from weights and a host block count.

#[allow(dead_code)] // the disk scenarios: disk_tier.rs and cuda.rs
pub(crate) mod disk;

use worker_svc::batch::{TierCopyInput, TierDirection};
use worker_svc::model::weights::Weights;
use worker_svc::worker::Worker;

use crate::common::{assert_bit_identical, fixed_model, run_one, seq_input, table};

/// Builds the worker under test for some weights with a host tier of that
/// many blocks per pool.
pub(crate) type TieredBuild<'a> = &'a dyn Fn(&Weights, u32) -> Worker;

/// Copies of one direction between device and host blocks, `pairs` of
/// (device, host), in both pools of a `fixed_model(vec![0, 32, 0], _)`.
pub(crate) fn tier_copies(direction: TierDirection, pairs: &[(u32, u32)]) -> Vec<TierCopyInput> {
    [0, 32]
        .into_iter()
        .flat_map(|window| {
            pairs
                .iter()
                .map(move |&(device_block, host_block)| TierCopyInput {
                    window,
                    direction,
                    device_block,
                    host_block,
                    disk: Default::default(),
                })
        })
        .collect()
}

fn apply(worker: &mut Worker, copies: &[TierCopyInput], what: &str) {
    if let Err(e) = worker.apply_tier_copies(copies) {
        panic!("{what}: {e}");
    }
}

/// A prefix demoted to the host tier survives its device blocks being
/// rewritten in the same request's pass, and onboarded into other device
/// blocks it gives logits bit-identical to recomputing it, through prefill
/// and a decode step; before the onboarding, a pass reading those blocks
/// is refused (they hold nothing).
pub(crate) fn onboarded_kv_is_bit_identical(build: TieredBuild<'_>) {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = build(&weights, 8);
    assert!(worker.info().pools.iter().all(|p| p.host_blocks == 8));
    let vocab = weights.config.vocab_size;
    let prefix: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 64).collect();
    let suffix: Vec<u32> = vec![5, 9, 33, 1, 60];
    let full: Vec<u32> = prefix.iter().chain(&suffix).copied().collect();
    let both = |ids: &[u32]| vec![table(0, 0, ids), table(32, 0, ids)];

    // A writes the prefix (blocks 10-12 full) and more.
    let a: Vec<u32> = prefix.iter().chain(&[2, 4]).copied().collect();
    run_one(&mut worker, 1, &a, 0, both(&[10, 11, 12, 13]));

    // The cache evicts blocks 10-12 and demotes them to host blocks 5-7;
    // in the same request, after the demotion, a new holder overwrites them.
    let demote = tier_copies(TierDirection::Demote, &[(10, 5), (11, 6), (12, 7)]);
    apply(&mut worker, &demote, "demote");
    let other: Vec<u32> = (0..12).map(|i| (i * 11 + 1) % 64).collect();
    run_one(&mut worker, 9, &other, 0, both(&[10, 11, 12]));

    // B's fresh blocks 40-42 hold nothing yet: its pass is refused.
    let b_tables = || both(&[40, 41, 42, 43, 44]);
    assert!(
        worker
            .forward(vec![seq_input(2, &suffix, 12, b_tables())])
            .is_err()
    );
    // Onboarded from the host, then B computes only its suffix and decodes.
    let onboard = tier_copies(TierDirection::Onboard, &[(40, 5), (41, 6), (42, 7)]);
    apply(&mut worker, &onboard, "onboard");
    let mut onboarded = run_one(&mut worker, 2, &suffix, 12, b_tables());
    onboarded.extend(run_one(&mut worker, 2, &[42], 17, b_tables()));

    // C recomputes everything in fresh blocks, then decodes.
    let c_tables = || both(&[30, 31, 32, 33, 34]);
    let all = run_one(&mut worker, 3, &full, 0, c_tables());
    let mut recomputed = all[prefix.len() * vocab..].to_vec();
    recomputed.extend(run_one(&mut worker, 3, &[42], 17, c_tables()));
    assert_bit_identical(&onboarded, &recomputed, "onboarded vs recomputed");
}

/// A Forward of tier copies alone (no sequence) runs them and answers no
/// results: a prefix demoted and onboarded elsewhere by two such requests
/// reads back bit-identical to the blocks it came from.
pub(crate) fn copies_only_forward(build: TieredBuild<'_>) {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = build(&weights, 4);
    let both = |ids: &[u32]| vec![table(0, 0, ids), table(32, 0, ids)];
    let prefix: Vec<u32> = (0..8).map(|i| (i * 5 + 2) % 64).collect();
    let a: Vec<u32> = prefix.iter().chain(&[3]).copied().collect();
    run_one(&mut worker, 1, &a, 0, both(&[1, 2, 3]));
    let only_copies = |worker: &mut Worker, copies: &[TierCopyInput], what: &str| {
        apply(worker, copies, what);
        match worker.forward_tokens(Vec::new()) {
            Ok(out) => assert!(out.is_empty(), "{what}: {} results", out.len()),
            Err(e) => panic!("{what}: {e}"),
        }
    };
    only_copies(
        &mut worker,
        &tier_copies(TierDirection::Demote, &[(1, 0), (2, 1)]),
        "demote",
    );
    only_copies(
        &mut worker,
        &tier_copies(TierDirection::Onboard, &[(7, 0), (8, 1)]),
        "onboard",
    );
    let from_copies = run_one(&mut worker, 2, &[3, 9], 8, both(&[7, 8, 9]));
    let from_source = run_one(&mut worker, 3, &[3, 9], 8, both(&[1, 2, 10]));
    assert_bit_identical(&from_copies, &from_source, "onboarded copy vs its source");
}

/// Blocks read from one worker's device (`Worker::peer_block`, a peer
/// pull's source) and written into another's (`Worker::write_pulled`, its
/// destination) give logits bit-identical to recomputing the prefix there,
/// through prefill and a decode step; a block the source did not fill is
/// refused.
pub(crate) fn pulled_kv_is_bit_identical(build: crate::common::Build<'_>) {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let vocab = weights.config.vocab_size;
    let both = |ids: &[u32]| vec![table(0, 0, ids), table(32, 0, ids)];
    let prefix: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 64).collect();
    let suffix: Vec<u32> = vec![5, 9, 33, 1, 60];
    let full: Vec<u32> = prefix.iter().chain(&suffix).copied().collect();

    // The source writes the prefix (blocks 10-12 full) and two more tokens
    // (block 13 half full).
    let mut source = build(&weights);
    let a: Vec<u32> = prefix.iter().chain(&[2, 4]).copied().collect();
    run_one(&mut source, 1, &a, 0, both(&[10, 11, 12, 13]));
    let pools = source.layout().pools.len();
    assert!(
        (0..pools).all(|pool| source.peer_block(pool, 13, 4).is_err()),
        "a half-written block is not served whole"
    );
    assert!(
        (0..pools).all(|pool| source.peer_block(pool, 13, 3).is_err()),
        "nor for more slots than it holds"
    );

    let mut dest = build(&weights);
    let mut pulled = Vec::new();
    for pool in 0..pools {
        for (from, to) in [(10, 40), (11, 41), (12, 42)] {
            match source.peer_block(pool, from, 4) {
                Ok(bytes) => pulled.push((pool, to, 4, bytes)),
                Err(e) => panic!("peer block {from} of pool {pool}: {e}"),
            }
        }
    }
    if let Err(e) = dest.write_pulled(&pulled) {
        panic!("write pulled: {e}");
    }
    let tables = || both(&[40, 41, 42, 43, 44]);
    let mut got = run_one(&mut dest, 2, &suffix, 12, tables());
    got.extend(run_one(&mut dest, 2, &[42], 17, tables()));

    let recompute = || both(&[30, 31, 32, 33, 34]);
    let all = run_one(&mut dest, 3, &full, 0, recompute());
    let mut want = all[12 * vocab..].to_vec();
    want.extend(run_one(&mut dest, 3, &[42], 17, recompute()));
    assert_bit_identical(&got, &want, "pulled vs recomputed");

    // A hand-off (disaggregated serving): every block of the source's
    // sequence, the half-full last one by its two written slots; the
    // destination computes only the token after them.
    let mut handoff = Vec::new();
    for pool in 0..pools {
        for (from, to, slots) in [(10, 50, 4), (11, 51, 4), (12, 52, 4), (13, 53, 2)] {
            match source.peer_block(pool, from, slots) {
                Ok(bytes) => handoff.push((pool, to, slots, bytes)),
                Err(e) => panic!("peer block {from} of pool {pool} ({slots} slots): {e}"),
            }
        }
    }
    if let Err(e) = dest.write_pulled(&handoff) {
        panic!("write pulled: {e}");
    }
    let got = run_one(&mut dest, 4, &[7], 14, both(&[50, 51, 52, 53]));
    let whole: Vec<u32> = a.iter().chain(&[7]).copied().collect();
    let all = run_one(&mut dest, 5, &whole, 0, both(&[60, 61, 62, 63]));
    assert_bit_identical(&got, &all[14 * vocab..], "handed off vs recomputed");
}
