//! Passes on the GPU: prefill rows against decoding them one by one, decode
//! from CUDA graphs against eager decode, and passes fed on the device from
//! the pass running before them against the same passes fed from the host.

use super::*;
#[test]
fn prefill_rows_are_bit_identical_to_decoding_them_one_by_one() {
    if !gpu_available("prefill_rows_equal_decode_rows") {
        return;
    }
    // Tensor-core shapes: query rows of one chunk share K/V tiles (and A
    // operands) in the attention kernel, a decode row runs alone; group
    // sizes 1, 2, 4 and 8 rows (8, 4, 2 and 1 query heads per KV head).
    for (heads, kv_heads, head_dim) in [(8, 1, 64), (8, 2, 64), (8, 4, 64), (4, 4, 64), (8, 2, 128)]
    {
        let config = ModelConfig {
            name: "tensor-core rows".into(),
            vocab_size: 50,
            hidden_size: 64,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            ffn_size: 96,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            rms_norm_eps: 1e-5,
            layer_windows: vec![0, 0],
            max_context: 512,
            tokens_per_block: 16,
            tied_embeddings: false,
            arch: Default::default(),
        };
        let weights = match Weights::seeded(config, 21) {
            Ok(w) => w,
            Err(e) => panic!("weights: {e}"),
        };
        let mut worker = gpu_worker(&weights);
        let tokens: Vec<u32> = (0..500).map(|i| (i * 7 + 3) % 50).collect();
        let run = |worker: &mut Worker, seq: u64, blocks: u32, start: usize, n: usize| {
            let ids: Vec<u32> = (blocks..blocks + 32).collect();
            let input = SeqInput {
                seq_id: seq,
                tokens: tokens[start..start + n].to_vec(),
                start_pos: start as u32,
                tables: vec![table(0, 0, &ids)],
                all_positions: true,
                logprobs: None,
                sampling: Sampling::GREEDY,
                copies: Vec::new(),
                history: None,
                grammar: None,
            };
            match worker.forward(vec![input]) {
                Ok(o) => o.logits(0).to_vec(),
                Err(e) => panic!("forward of {seq} at {start}: {e}"),
            }
        };
        // The whole sequence as one chunk (its products spread over several
        // streams), then again as a 400-token chunk followed by one decode
        // step per token (products of one row tile on the pass's stream).
        let chunk = run(&mut worker, 1, 0, 0, tokens.len());
        let mut stepped = run(&mut worker, 2, 40, 0, 400);
        for p in 400..tokens.len() {
            stepped.extend(run(&mut worker, 2, 40, p, 1));
        }
        assert_eq!(chunk.len(), stepped.len());
        if let Some(i) = (0..chunk.len()).find(|&i| chunk[i].to_bits() != stepped[i].to_bits()) {
            panic!(
                "{heads}/{kv_heads} heads of {head_dim}: logit {i} (row {}) differs: {} chunked vs {} decoded",
                i / 50,
                chunk[i],
                stepped[i]
            );
        }
    }
}

#[test]
fn decode_from_graphs_is_bit_identical_to_eager_decode() {
    if !gpu_available("decode_graphs_equal_eager") {
        return;
    }
    // Two pools (full and a window of 32), tensor-core heads; batches of 1
    // to 24 decode rows (row buckets 8, 16 and 32) whose keys grow from 6 to
    // 114 (key buckets 8 to 128), so graphs are captured for several
    // buckets and replayed over new metadata each step.
    let weights = tensor_core_model("graphs", vec![0, 32], 512, 23);
    let worker = |decode_graphs: bool| batch_worker(&weights, 64, 8 << 20, decode_graphs);
    let (mut graphed, mut eager) = (worker(true), worker(false));
    const SEQS: usize = 24;
    let token = |s: usize, p: usize| ((s * 7 + p * 3) % 50) as u32;
    let input = |s: usize, start: usize, end: usize| {
        let ids: Vec<u32> = (s as u32 * 8..s as u32 * 8 + 8).collect();
        SeqInput {
            seq_id: s as u64 + 1,
            tokens: (start..end).map(|p| token(s, p)).collect(),
            start_pos: start as u32,
            tables: vec![table(0, 0, &ids), table(32, 0, &ids)],
            all_positions: false,
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    };
    let mut both = |inputs: Vec<SeqInput>, what: &str| {
        let a = match graphed.forward(inputs.clone()) {
            Ok(o) => o,
            Err(e) => panic!("{what}, graphs: {e}"),
        };
        let b = match eager.forward(inputs.clone()) {
            Ok(o) => o,
            Err(e) => panic!("{what}, eager: {e}"),
        };
        for (k, seq) in inputs.iter().enumerate() {
            let (x, y) = (a.logits(k), b.logits(k));
            if let Some(i) = (0..x.len()).find(|&i| x[i].to_bits() != y[i].to_bits()) {
                panic!(
                    "{what}: sequence {} at {}, logit {i}: {} from a graph, {} eager",
                    seq.seq_id, seq.start_pos, x[i], y[i]
                );
            }
        }
    };
    let mut pos: Vec<usize> = (0..SEQS).map(|s| 5 + 3 * s).collect();
    both((0..SEQS).map(|s| input(s, 0, pos[s])).collect(), "prefill");
    let sizes = [24, 13, 1, 7, 3, 24, 16, 9];
    let steps = 40;
    for step in 0..steps {
        let n = sizes[step % sizes.len()];
        let chosen: Vec<usize> = (0..n).map(|i| (step * 5 + i) % SEQS).collect();
        let inputs = chosen
            .iter()
            .map(|&s| input(s, pos[s], pos[s] + 1))
            .collect();
        both(inputs, &format!("decode step {step} of {n} sequences"));
        for s in chosen {
            pos[s] += 1;
        }
    }
    let (g, e) = (graphed.graph_counts(), eager.graph_counts());
    assert_eq!(g.replays, steps as u64, "every decode step from a graph");
    assert!(
        g.captures >= 3 && g.captures < g.replays,
        "graphs of several buckets, reused: {g:?}"
    );
    assert_eq!(e.replays + e.captures, 0, "no graph with decode_graphs off");
}

#[test]
fn passes_fed_on_the_device_while_the_pass_before_runs_equal_passes_fed_from_the_host() {
    if !gpu_available("device_fed_passes") {
        return;
    }
    // Six sequences prefill at step 0 and then decode, each pass begun
    // while the one before still runs, its tokens taken on the device from
    // that pass's argmax rows; a seventh joins with a prefill chunk at step
    // 5 (a mixed batch: no graph) and is fed from step 6 on. The tokens
    // must equal those of passes run one at a time with every token fed
    // from the host.
    let weights = fixed_model(vec![0], 4);
    const SEQS: usize = 7;
    const STEPS: usize = 24;
    let prompt =
        |s: usize| -> Vec<u32> { (0..3 + s).map(|p| ((s * 11 + p * 5) % 64) as u32).collect() };
    let joins = |s: usize| if s == SEQS - 1 { 5 } else { 0 };
    let input = |s: usize, tokens: Vec<u32>, start: usize| {
        let ids: Vec<u32> = (s as u32 * 16..s as u32 * 16 + 16).collect();
        SeqInput {
            seq_id: s as u64 + 1,
            tokens,
            start_pos: start as u32,
            tables: vec![table(0, 0, &ids)],
            all_positions: false,
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    };
    // per step, the sequences it runs: (sequence, prefill?)
    let schedule = |step: usize| -> Vec<(usize, bool)> {
        (0..SEQS)
            .filter(|&s| step >= joins(s))
            .map(|s| (s, step == joins(s)))
            .collect()
    };
    let mut host = gpu_worker(&weights);
    let mut sampled = vec![Vec::new(); SEQS];
    let mut pos = [0usize; SEQS];
    for step in 0..STEPS {
        let runs = schedule(step);
        let inputs = runs
            .iter()
            .map(|&(s, prefill)| {
                let tokens = if prefill {
                    prompt(s)
                } else {
                    vec![*sampled[s].last().unwrap()]
                };
                input(s, tokens, pos[s])
            })
            .collect();
        let outputs = host.forward_tokens(inputs).unwrap();
        for (&(s, _), o) in runs.iter().zip(&outputs) {
            pos[s] += if sampled[s].is_empty() {
                prompt(s).len()
            } else {
                1
            };
            sampled[s].push(o.next_token);
        }
    }
    let mut device = gpu_worker(&weights);
    let mut fed = vec![Vec::new(); SEQS];
    let mut pos = [0usize; SEQS];
    let mut running: Option<(Vec<(usize, bool)>, worker_svc::worker::RunningPass)> = None;
    let finish =
        |device: &mut Worker,
         fed: &mut Vec<Vec<u32>>,
         (runs, pass): (Vec<(usize, bool)>, worker_svc::worker::RunningPass)| {
            let tokens = pass.tokens.wait().unwrap();
            for (&(s, _), o) in runs.iter().zip(device.finish_tokens(pass.rest, tokens)) {
                fed[s].push(o.next_token);
            }
        };
    for step in 0..STEPS {
        let runs = schedule(step);
        let rows: std::collections::HashMap<u64, u32> = running
            .as_ref()
            .map(|(_, p)| p.last_rows().collect())
            .unwrap_or_default();
        let mut feed = Vec::new();
        let inputs = runs
            .iter()
            .enumerate()
            .map(|(i, &(s, prefill))| {
                let tokens = if prefill {
                    prompt(s)
                } else {
                    feed.push((i, rows[&(s as u64 + 1)]));
                    vec![0]
                };
                let start = pos[s];
                pos[s] += tokens.len();
                input(s, tokens, start)
            })
            .collect();
        let begun = device.begin_tokens(inputs, &feed).unwrap();
        let worker_svc::worker::Begun::Running(pass) = begun else {
            panic!("step {step}: a greedy pass on the GPU keeps its tokens on the device");
        };
        // the pass before is finished only now, with this one begun behind it
        if let Some(before) = running.replace((runs, pass)) {
            finish(&mut device, &mut fed, before);
        }
    }
    if let Some(last) = running.take() {
        finish(&mut device, &mut fed, last);
    }
    assert_eq!(
        fed, sampled,
        "tokens fed on the device == tokens fed from the host"
    );
    assert!(
        device.graph_counts().replays > 0,
        "decode passes from graphs were fed too"
    );
}

/// A pass with picks and logprobs (run to its end at once) may be fed on
/// the device from the greedy pass running before it: a new sampled
/// request with logprobs joins decoding greedy ones (it failed before).
/// Its tokens and logprobs equal those of the same passes fed from the host.
#[test]
fn a_pass_with_picks_and_logprobs_is_fed_on_the_device_like_from_the_host() {
    use worker_svc::batch::LogprobsSpec;
    if !gpu_available("a_pass_with_picks_is_fed_on_the_device") {
        return;
    }
    let weights = fixed_model(vec![0], 4);
    let input = |s: u32, tokens: Vec<u32>, start: u32, sampling: Sampling, logprobs| {
        let ids: Vec<u32> = (s * 16..s * 16 + 16).collect();
        SeqInput {
            seq_id: u64::from(s),
            tokens,
            start_pos: start,
            tables: vec![table(0, 0, &ids)],
            all_positions: false,
            logprobs,
            sampling,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    };
    let prompt: Vec<u32> = (0..9).map(|p| (p * 7 + 3) % 64).collect();
    let hot = Sampling {
        temperature: 0.9,
        seed: 4,
        ..Sampling::GREEDY
    };
    let asked = Some(LogprobsSpec {
        top: 3,
        prompt: false,
        next_prompt_token: None,
    });
    let second = |first: u32| {
        vec![
            input(1, vec![first], 9, Sampling::GREEDY, None),
            input(2, prompt.clone(), 0, hot.clone(), asked),
        ]
    };
    let mut host = gpu_worker(&weights);
    let a = host
        .forward_tokens(vec![input(1, prompt.clone(), 0, Sampling::GREEDY, None)])
        .unwrap();
    let b = host.forward_tokens(second(a[0].next_token)).unwrap();

    let mut device = gpu_worker(&weights);
    let begun = device
        .begin_tokens(
            vec![input(1, prompt.clone(), 0, Sampling::GREEDY, None)],
            &[],
        )
        .unwrap();
    let worker_svc::worker::Begun::Running(pass) = begun else {
        panic!("a greedy pass on the GPU keeps its tokens on the device");
    };
    let row = pass.last_rows().next().unwrap().1;
    let fed = match device.begin_tokens(second(0), &[(0, row)]).unwrap() {
        worker_svc::worker::Begun::Done(outputs) => outputs,
        worker_svc::worker::Begun::Running(_) => panic!("a pass with picks runs to its end"),
    };
    let tokens = pass.tokens.wait().unwrap();
    let first = device.finish_tokens(pass.rest, tokens);
    assert_eq!(first[0].next_token, a[0].next_token);
    assert_eq!(
        fed.iter().map(|o| o.next_token).collect::<Vec<_>>(),
        b.iter().map(|o| o.next_token).collect::<Vec<_>>(),
        "fed on the device == fed from the host"
    );
    assert_eq!(fed[1].logprobs.len(), 1);
    let (d, h) = (&fed[1].logprobs[0], &b[1].logprobs[0]);
    assert_eq!((d.token, d.top.len()), (h.token, 3));
    assert!((d.logprob - h.logprob).abs() <= 1e-5 * h.logprob.abs().max(1.0));
}

/// A pass with sampled rows fed on the device from the greedy pass running
/// before it (a sampled request joining greedy decodes: its picks need no
/// fed token) picks what the same passes pick fed from the host.
#[test]
fn a_sampled_pass_fed_on_the_device_equals_one_fed_from_the_host() {
    use worker_svc::worker::Begun;
    if !gpu_available("sampled_pass_fed_on_the_device") {
        return;
    }
    let weights = fixed_model(vec![0], 4);
    let input = |s: u64, tokens: Vec<u32>, start: u32, sampling: Sampling| {
        let ids: Vec<u32> = (s as u32 * 16..s as u32 * 16 + 16).collect();
        SeqInput {
            seq_id: s,
            tokens,
            start_pos: start,
            tables: vec![table(0, 0, &ids)],
            all_positions: false,
            sampling,
            copies: Vec::new(),
            history: None,
            grammar: None,
            logprobs: None,
        }
    };
    let greedy = || Sampling::GREEDY;
    let hot = Sampling {
        temperature: 0.9,
        seed: 3,
        ..Sampling::GREEDY
    };
    let prompt = |s: u64| -> Vec<u32> { (0..4).map(|p| ((s * 7 + p * 5) % 64) as u32).collect() };
    let first = || {
        vec![
            input(1, prompt(1), 0, greedy()),
            input(2, prompt(2), 0, greedy()),
        ]
    };
    let second = |a: u32, b: u32| {
        vec![
            input(1, vec![a], 4, greedy()),
            input(2, vec![b], 4, greedy()),
            input(3, prompt(3), 0, hot.clone()),
        ]
    };
    let next =
        |o: &[worker_svc::worker::SeqOutput]| o.iter().map(|s| s.next_token).collect::<Vec<_>>();
    let mut host = gpu_worker(&weights);
    let first_host = next(&host.forward_tokens(first()).unwrap());
    let second_host = next(
        &host
            .forward_tokens(second(first_host[0], first_host[1]))
            .unwrap(),
    );
    let mut device = gpu_worker(&weights);
    let Begun::Running(pass) = device.begin_tokens(first(), &[]).unwrap() else {
        panic!("a greedy pass on the GPU keeps its tokens on the device");
    };
    let rows: std::collections::HashMap<u64, u32> = pass.last_rows().collect();
    let begun = device
        .begin_tokens(second(0, 0), &[(0, rows[&1]), (1, rows[&2])])
        .unwrap();
    let Begun::Done(second_device) = begun else {
        panic!("sampled rows are picked at once");
    };
    let tokens = pass.tokens.wait().unwrap();
    let first_device = next(&device.finish_tokens(pass.rest, tokens));
    assert_eq!(first_device, first_host);
    assert_eq!(
        next(&second_device),
        second_host,
        "fed on the device == fed from the host"
    );
}

#[test]
fn a_rows_attention_has_the_same_bits_whether_its_batch_needs_key_splits_or_not() {
    if !gpu_available("one_split_equals_merged_splits") {
        return;
    }
    // A decode row whose batch attends at most one split of keys (2,048) is
    // written by the attention kernel itself; next to a row of more keys,
    // the batch needs two splits and the rows go through the merge. The
    // short row must give the same bits either way (prefix reuse and batch
    // invariance rest on it). Tensor-core heads; both orders of the batch.
    let weights = tensor_core_model("splits", vec![0, 0], 4096, 29);
    for decode_graphs in [true, false] {
        let mut worker = batch_worker(&weights, 8, 64 << 20, decode_graphs);
        let ids = |from: u32, n: u32| (from..from + n).collect::<Vec<u32>>();
        let short: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 50).collect();
        let long: Vec<u32> = (0..2100).map(|i| (i * 13 + 1) % 50).collect();
        // two copies of the short sequence (1 and 2) and the long one (3)
        let blocks = [ids(0, 4), ids(10, 4), ids(100, 140)];
        let input = |seq: usize, tokens: &[u32], start: u32| {
            let mut s = common::seq_input(
                seq as u64 + 1,
                tokens,
                start,
                vec![table(0, 0, &blocks[seq])],
            );
            s.all_positions = false;
            s
        };
        let forward = |worker: &mut Worker, seqs: Vec<SeqInput>| match worker.forward(seqs) {
            Ok(out) => out,
            Err(e) => panic!("forward: {e}"),
        };
        forward(&mut worker, vec![input(0, &short, 0), input(1, &short, 0)]);
        forward(&mut worker, vec![input(2, &long, 0)]);
        // the short row's next token alone: one split
        let alone = forward(&mut worker, vec![input(0, &[9], 40)])
            .logits(0)
            .to_vec();
        // the same row (its copy) next to the long row: two splits, merged
        let both = forward(&mut worker, vec![input(2, &[9], 2100), input(1, &[9], 40)]);
        assert_eq!(
            both.logits(1),
            &alone[..],
            "graphs {decode_graphs}: the short row's logits differ when its batch needs key splits"
        );
        let again = forward(&mut worker, vec![input(1, &[4], 41), input(2, &[4], 2101)]);
        let alone_again = forward(&mut worker, vec![input(0, &[4], 41)])
            .logits(0)
            .to_vec();
        assert_eq!(
            again.logits(0),
            &alone_again[..],
            "graphs {decode_graphs}: the short row first in its batch"
        );
    }
}

/// Seeded weights of a small model with tensor-core heads (8 query and 2
/// KV heads of 64), `layer_windows` as given, 16-token blocks.
fn tensor_core_model(name: &str, layer_windows: Vec<u32>, max_context: u32, seed: u64) -> Weights {
    let config = ModelConfig {
        name: name.into(),
        vocab_size: 50,
        hidden_size: 64,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        ffn_size: 96,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        rms_norm_eps: 1e-5,
        layer_windows,
        max_context,
        tokens_per_block: 16,
        tied_embeddings: false,
        arch: Default::default(),
    };
    match Weights::seeded(config, seed) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    }
}

/// A CUDA worker of `weights` taking batches of up to `max_seqs` sequences
/// and 4,096 tokens in an arena of `max_kv_bytes`, decode from graphs or not.
fn batch_worker(
    weights: &Weights,
    max_seqs: usize,
    max_kv_bytes: u64,
    decode_graphs: bool,
) -> Worker {
    let options = WorkerOptions {
        limits: Limits {
            max_batch_sequences: max_seqs,
            max_batch_tokens: 4096,
        },
        ..options()
    };
    let gpu = CudaOptions {
        max_kv_bytes,
        decode_graphs,
        ..CudaOptions::default()
    };
    match Worker::new_cuda(weights.clone(), options, gpu) {
        Ok(w) => w,
        Err(e) => panic!("cuda worker: {e}"),
    }
}
