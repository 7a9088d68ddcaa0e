//! The host-memory tier on the CPU backend: a demoted block survives its
//! device block being rewritten, and onboarding it back gives K/V
//! bit-identical to recomputing it (same logits, through prefill and a
//! decode step); the slot ledger follows the copies; malformed copies and
//! a worker without a tier are refused.

// Only the fixed model and table helpers of the shared scenarios are used here.
#[allow(dead_code)]
mod common;

use common::{fixed_model, seq_input as seq, table};
use worker_svc::Error;
use worker_svc::batch::{SeqInput, TierCopyInput, TierDirection};
use worker_svc::model::weights::Weights;
use worker_svc::worker::{Worker, WorkerOptions};

fn tiered_worker(weights: &Weights, host_blocks: u32) -> Worker {
    let options = WorkerOptions {
        host_blocks,
        ..common::options()
    };
    Worker::new_cpu(weights.clone(), options).unwrap_or_else(|e| panic!("worker: {e}"))
}

fn run(worker: &mut Worker, s: SeqInput) -> Vec<f32> {
    let id = s.seq_id;
    match worker.forward(vec![s]) {
        Ok(out) => out.logits(0).to_vec(),
        Err(e) => panic!("forward of {id}: {e}"),
    }
}

fn copies(direction: TierDirection, pairs: &[(u32, u32)]) -> Vec<TierCopyInput> {
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
                })
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn onboarded_kv_is_bit_identical_to_recomputed_kv() {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = tiered_worker(&weights, 8);
    assert!(worker.info().pools.iter().all(|p| p.host_blocks == 8));
    let vocab = weights.config.vocab_size;
    let prefix: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 64).collect();
    let suffix: Vec<u32> = vec![5, 9, 33, 1, 60];
    let full: Vec<u32> = prefix.iter().chain(&suffix).copied().collect();
    let both = |ids: &[u32]| vec![table(0, 0, ids), table(32, 0, ids)];

    // A writes the prefix (blocks 10-12 full) and more.
    let a: Vec<u32> = prefix.iter().chain(&[2, 4]).copied().collect();
    run(&mut worker, seq(1, &a, 0, both(&[10, 11, 12, 13])));

    // The cache evicts blocks 10-12 and demotes them to host blocks 5-7;
    // in the same pass, after the demotion, a new holder overwrites them.
    worker
        .apply_tier_copies(&copies(TierDirection::Demote, &[(10, 5), (11, 6), (12, 7)]))
        .unwrap_or_else(|e| panic!("demote: {e}"));
    let other: Vec<u32> = (0..12).map(|i| (i * 11 + 1) % 64).collect();
    run(&mut worker, seq(9, &other, 0, both(&[10, 11, 12])));

    // B's fresh blocks 40-42 hold nothing yet: its pass is refused.
    let b_tables = || both(&[40, 41, 42, 43, 44]);
    assert!(
        worker
            .forward(vec![seq(2, &suffix, 12, b_tables())])
            .is_err()
    );
    // Onboarded from the host, then B computes only its suffix and decodes.
    worker
        .apply_tier_copies(&copies(
            TierDirection::Onboard,
            &[(40, 5), (41, 6), (42, 7)],
        ))
        .unwrap_or_else(|e| panic!("onboard: {e}"));
    let mut onboarded = run(&mut worker, seq(2, &suffix, 12, b_tables()));
    onboarded.extend(run(&mut worker, seq(2, &[42], 17, b_tables())));

    // C recomputes everything in fresh blocks, then decodes.
    let c_tables = || both(&[30, 31, 32, 33, 34]);
    let all = run(&mut worker, seq(3, &full, 0, c_tables()));
    let mut recomputed = all[prefix.len() * vocab..].to_vec();
    recomputed.extend(run(&mut worker, seq(3, &[42], 17, c_tables())));
    assert_eq!(
        bits(&onboarded),
        bits(&recomputed),
        "onboarded vs recomputed"
    );
}

#[test]
fn a_forward_of_copies_only_runs_them_and_answers_no_results() {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = tiered_worker(&weights, 4);
    let prefix: Vec<u32> = (0..8).collect();
    run(
        &mut worker,
        seq(
            1,
            &prefix,
            0,
            vec![table(0, 0, &[1, 2]), table(32, 0, &[1, 2])],
        ),
    );
    worker
        .apply_tier_copies(&copies(TierDirection::Demote, &[(1, 0), (2, 1)]))
        .unwrap_or_else(|e| panic!("{e}"));
    let out = worker
        .forward_tokens(Vec::new())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(out.is_empty());
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

/// The cuda backend has no host tier yet: asked for one, it refuses at
/// start-up, before it touches a device (so this runs without a GPU).
#[cfg(feature = "cuda")]
#[test]
fn a_cuda_worker_asked_for_a_host_tier_refuses_at_start_up() {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let options = WorkerOptions {
        host_blocks: 8,
        ..common::options()
    };
    let gpu = worker_svc::backend::CudaOptions::default();
    match Worker::new_cuda(weights, options, gpu) {
        Err(Error::Config(message)) => {
            assert!(message.contains("host-memory tier"), "{message}")
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
}
