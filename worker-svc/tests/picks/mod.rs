//! Picking on the GPU: greedy tokens, every sampling parameter, logprobs
//! and grammar masks applied on the device against the host's picks from
//! the same logits.

use super::*;
#[test]
fn greedy_tokens_picked_on_the_device_equal_the_hosts_argmax() {
    if !gpu_available("greedy_tokens_on_the_device") {
        return;
    }
    let weights = match Weights::seeded(ModelConfig::small(), 9) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    };
    let mut worker = gpu_worker(&weights);
    let windows: Vec<u32> = worker.layout().pools.iter().map(|p| p.window).collect();
    let tables = |s: u32| -> Vec<TableInput> {
        let ids: Vec<u32> = (s * 20..(s + 1) * 20).collect();
        windows.iter().map(|&w| table(w, 0, &ids)).collect()
    };
    let vocab = weights.config.vocab_size as u32;
    let seq = |s: u32, n: u32, start: u32, all_positions: bool, sampling: Sampling| SeqInput {
        seq_id: u64::from(s),
        tokens: (0..n).map(|i| (i * 11 + s * 29 + 3) % vocab).collect(),
        start_pos: start,
        tables: tables(s),
        all_positions,
        logprobs: None,
        sampling,
        copies: Vec::new(),
        history: None,
        grammar: None,
    };
    let sampled = Sampling {
        temperature: 0.8,
        top_p: 0.9,
        seed: 17,
        ..Sampling::GREEDY
    };
    // Greedy prefill rows (every position, and the last only), then a batch
    // with a sampled sequence (drawn on the device too).
    let batches = [
        vec![
            seq(0, 40, 0, true, Sampling::GREEDY),
            seq(1, 25, 0, false, Sampling::GREEDY),
            seq(2, 7, 0, true, Sampling::GREEDY),
        ],
        vec![
            seq(0, 1, 40, false, Sampling::GREEDY),
            seq(1, 3, 25, true, sampled),
            seq(2, 1, 7, false, Sampling::GREEDY),
        ],
    ];
    for (i, batch) in batches.into_iter().enumerate() {
        // The same batch twice writes the same K/V into the same slots.
        let with_logits = match worker.forward(batch.clone()) {
            Ok(o) => o,
            Err(e) => panic!("forward of batch {i}: {e}"),
        };
        let tokens_only = match worker.forward_tokens(batch) {
            Ok(o) => o,
            Err(e) => panic!("forward_tokens of batch {i}: {e}"),
        };
        assert_eq!(tokens_only, with_logits.seqs, "batch {i}");
        println!(
            "batch {i}: {:?}",
            tokens_only.iter().map(|o| o.next_token).collect::<Vec<_>>()
        );
    }
}

/// `batch` run twice (the same K/V written into the same slots): with its
/// logits downloaded and picked on the host (`forward`), then picked on the
/// device (`forward_tokens`).
fn host_and_device(
    worker: &mut Worker,
    batch: Vec<SeqInput>,
) -> (
    worker_svc::worker::ForwardOutput,
    Vec<worker_svc::worker::SeqOutput>,
) {
    let on_host = match worker.forward(batch.clone()) {
        Ok(o) => o,
        Err(e) => panic!("forward: {e}"),
    };
    match worker.forward_tokens(batch) {
        Ok(o) => (on_host, o),
        Err(e) => panic!("forward_tokens: {e}"),
    }
}

/// A row's logprobs from the device `d` against the host's `h`: the same
/// tokens, the values within 1e-5 relative (the device's sums reduce in
/// another order).
fn assert_logprobs_match(
    d: &worker_svc::logprobs::RowLogprobs,
    h: &worker_svc::logprobs::RowLogprobs,
    what: &str,
) {
    assert_eq!(d.token, h.token, "{what}");
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
    assert!(
        close(d.logprob, h.logprob),
        "{what}: {} on the device, {} on the host",
        d.logprob,
        h.logprob
    );
    let tokens =
        |r: &worker_svc::logprobs::RowLogprobs| r.top.iter().map(|t| t.0).collect::<Vec<_>>();
    assert_eq!(tokens(d), tokens(h), "{what}");
    for (a, b) in d.top.iter().zip(&h.top) {
        assert!(
            close(a.1, b.1),
            "{what}: {a:?} on the device, {b:?} on the host"
        );
    }
}

/// Every sampling parameter, alone and together, picked on the device
/// (`forward_tokens`: `adjust_logits`, `argmax_rows`, `sample_rows`) equals
/// the host's pick from the same logits (`forward` downloads them), over
/// many seeds; a vocabulary over the kernel's 1024 threads so each thread
/// walks a run of ids.
#[test]
fn device_sampling_equals_the_hosts_for_every_parameter() {
    use worker_svc::batch::Penalties;
    if !gpu_available("device_sampling_equals_the_hosts") {
        return;
    }
    let (weights, mut worker) = wide_vocab_gpu_worker(5);
    let windows: Vec<u32> = worker.layout().pools.iter().map(|p| p.window).collect();
    let vocab = weights.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % vocab).collect();
    let hot = |seed: u64| Sampling {
        temperature: 1.3,
        seed,
        prompt_len: 20,
        ..Sampling::GREEDY
    };
    let penalties = |frequency, presence, repetition| Penalties {
        frequency,
        presence,
        repetition,
    };
    let cases = |seed: u64| -> Vec<(&'static str, Sampling)> {
        vec![
            ("temperature", hot(seed)),
            (
                "cold",
                Sampling {
                    temperature: 0.3,
                    ..hot(seed)
                },
            ),
            (
                "top_k",
                Sampling {
                    top_k: 5,
                    ..hot(seed)
                },
            ),
            (
                "top_k 1",
                Sampling {
                    top_k: 1,
                    ..hot(seed)
                },
            ),
            (
                "top_p",
                Sampling {
                    top_p: 0.5,
                    ..hot(seed)
                },
            ),
            (
                "min_p",
                Sampling {
                    min_p: 0.05,
                    ..hot(seed)
                },
            ),
            (
                "frequency",
                Sampling {
                    penalties: penalties(1.5, 0.0, 1.0),
                    ..hot(seed)
                },
            ),
            (
                "presence",
                Sampling {
                    penalties: penalties(0.0, -1.0, 1.0),
                    ..hot(seed)
                },
            ),
            (
                "repetition",
                Sampling {
                    penalties: penalties(0.0, 0.0, 1.7),
                    ..hot(seed)
                },
            ),
            (
                "logit_bias",
                Sampling {
                    logit_bias: vec![(3, -100.0), (7, 4.0), (2999, 2.5)],
                    ..hot(seed)
                },
            ),
            (
                "min_tokens",
                Sampling {
                    min_tokens: 10,
                    stop_ids: (0..40).collect(),
                    ..hot(seed)
                },
            ),
            (
                "greedy with bias and penalties",
                Sampling {
                    logit_bias: vec![(5, 3.0)],
                    penalties: penalties(0.5, 0.5, 1.2),
                    ..Sampling::GREEDY
                },
            ),
            (
                "all of them",
                Sampling {
                    top_k: 40,
                    top_p: 0.8,
                    min_p: 0.01,
                    penalties: penalties(0.7, 0.3, 1.1),
                    logit_bias: vec![(1, -100.0), (9, 1.0)],
                    min_tokens: 6,
                    stop_ids: vec![0, 2],
                    ..hot(seed)
                },
            ),
        ]
    };
    let mut compared = 0;
    for seed in 0..24u64 {
        let batch: Vec<SeqInput> = cases(seed)
            .into_iter()
            .enumerate()
            .map(|(s, (_, sampling))| {
                let s = s as u32;
                let ids: Vec<u32> = (s * 4..(s + 1) * 4).collect();
                SeqInput {
                    seq_id: u64::from(s),
                    // a different last token per sequence and seed
                    tokens: prompt
                        .iter()
                        .map(|t| (t + s * 13 + seed as u32 * 7) % vocab)
                        .collect(),
                    start_pos: 0,
                    tables: windows.iter().map(|&w| table(w, 0, &ids)).collect(),
                    all_positions: false,
                    logprobs: None,
                    sampling,
                    copies: Vec::new(),
                    history: Some(Vec::new()),
                    grammar: None,
                }
            })
            .collect();
        let (on_host, on_device) = host_and_device(&mut worker, batch);
        for (i, (name, _)) in cases(seed).iter().enumerate() {
            assert_eq!(
                on_device[i].next_token, on_host.seqs[i].next_token,
                "{name}, seed {seed}"
            );
            compared += 1;
        }
        assert_ne!(on_device[9].next_token, 3, "a bias of -100 bans the token");
        assert!(
            on_device[10].next_token >= 40,
            "min_tokens holds the stop ids back"
        );
    }
    println!("{compared} picks equal on the device and the host");
}

/// Log-probabilities computed on the device (`forward_tokens`:
/// `keep_logits` around the picking, `logprob_rows`) equal the host's
/// (`forward` downloads the logits and runs `logprobs::row_logprobs`) from
/// the same logits: greedy and sampled rows, adjusted rows (the raw values
/// put back), a prompt's every position with the next chunk's token, 0 to
/// 20 alternatives, a vocabulary over the kernel's 1024 threads.
#[test]
fn device_logprobs_equal_the_hosts() {
    use worker_svc::batch::{LogprobsSpec, Penalties};
    if !gpu_available("device_logprobs_equal_the_hosts") {
        return;
    }
    let (weights, mut worker) = wide_vocab_gpu_worker(5);
    let windows: Vec<u32> = worker.layout().pools.iter().map(|p| p.window).collect();
    let vocab = weights.config.vocab_size as u32;
    let spec = |top: u32, prompt: bool, next_prompt_token: Option<u32>| {
        Some(LogprobsSpec {
            top,
            prompt,
            next_prompt_token,
        })
    };
    let hot = Sampling {
        temperature: 1.1,
        seed: 3,
        prompt_len: 20,
        ..Sampling::GREEDY
    };
    let adjusted = Sampling {
        logit_bias: vec![(3, -100.0), (7, 40.0)],
        penalties: Penalties {
            frequency: 1.0,
            presence: 0.5,
            repetition: 1.5,
        },
        ..hot.clone()
    };
    let cases = [
        ("greedy, top 5", Sampling::GREEDY, spec(5, false, None)),
        ("sampled, top 20", hot.clone(), spec(20, false, None)),
        ("adjusted, top 3", adjusted.clone(), spec(3, false, None)),
        ("no alternatives", Sampling::GREEDY, spec(0, false, None)),
        (
            "a prompt chunk",
            Sampling::GREEDY,
            spec(4, true, Some(vocab - 1)),
        ),
        ("a prompt's last chunk", adjusted, spec(2, true, None)),
        ("no logprobs", hot, None),
    ];
    for round in 0..4u32 {
        let batch: Vec<SeqInput> = cases
            .iter()
            .enumerate()
            .map(|(s, (_, sampling, logprobs))| {
                let s = s as u32;
                let ids: Vec<u32> = (s * 4..(s + 1) * 4).collect();
                SeqInput {
                    seq_id: u64::from(s),
                    tokens: (0..24)
                        .map(|i| (i * 37 + 11 + s * 13 + round * 7) % vocab)
                        .collect(),
                    start_pos: 0,
                    tables: windows.iter().map(|&w| table(w, 0, &ids)).collect(),
                    all_positions: false,
                    logprobs: *logprobs,
                    sampling: sampling.clone(),
                    copies: Vec::new(),
                    history: Some(Vec::new()),
                    grammar: None,
                }
            })
            .collect();
        let (on_host, on_device) = host_and_device(&mut worker, batch);
        for (i, (name, _, logprobs)) in cases.iter().enumerate() {
            let (host, device) = (&on_host.seqs[i], &on_device[i]);
            assert_eq!(device.next_token, host.next_token, "{name}, round {round}");
            let rows = match logprobs {
                Some(l) if l.prompt => 24,
                Some(_) => 1,
                None => 0,
            };
            assert_eq!(device.logprobs.len(), rows, "{name}");
            assert_eq!(host.logprobs.len(), rows, "{name}");
            for (d, h) in device.logprobs.iter().zip(&host.logprobs) {
                assert_logprobs_match(d, h, &format!("{name}, round {round}"));
            }
            if let Some(l) = logprobs {
                let last = &device.logprobs[rows - 1];
                assert_eq!(last.top.len(), l.top as usize, "{name}");
                match l.next_prompt_token {
                    Some(t) => assert_eq!(last.token, t, "{name}"),
                    None => assert_eq!(last.token, device.next_token, "{name}"),
                }
            }
        }
    }
}

/// Structured output: grammar masks applied on the device (`mask_logits`
/// after `adjust_logits`, then `argmax_rows` / `sample_rows`;
/// `forward_tokens`) pick what the host picks from the same logits with the
/// same mask (`forward`), greedy and sampled, with a bias pulling towards a
/// token the grammar refuses, mid-grammar and once complete (the end token
/// alone); every pick is one the grammar allows. The byte-level tokenizer
/// over a 3001-token model: ids past it are never allowed. Run again with
/// logprobs (the next token's, 0 to 20 alternatives, and one sequence's
/// every prompt position): the device keeps a constrained row's raw values
/// around the mask (`keep_rows`), so its logprobs equal the host's and
/// `logprobs::row_logprobs` of the raw logits the host downloaded, the
/// picks being the same as without logprobs.
#[test]
fn grammar_masks_applied_on_the_device_pick_as_the_host() {
    use kvlease_tokenizer::grammar::{Constraint, allowed};
    use kvlease_tokenizer::{Tokenizer, byte_level};
    use worker_svc::batch::LogprobsSpec;
    use worker_svc::logprobs::row_logprobs;
    if !gpu_available("grammar_masks_applied_on_the_device") {
        return;
    }
    let (weights, mut worker) = wide_vocab_gpu_worker(9);
    let tokenizer = Tokenizer::byte_level();
    worker.set_tokenizer(tokenizer.clone());
    let windows: Vec<u32> = worker.layout().pools.iter().map(|p| p.window).collect();
    let vocab = weights.config.vocab_size;
    let hot = |seed: u64| Sampling {
        temperature: 1.2,
        seed,
        ..Sampling::GREEDY
    };
    let cases =
        |seed: u64| -> Vec<(&'static str, Sampling, Constraint, &'static str)> {
            vec![
            (
                "greedy regex",
                Sampling::GREEDY,
                Constraint::Regex("ab[0-9]{2,5}".into()),
                "ab1",
            ),
            ("sampled json_object", hot(seed), Constraint::JsonObject, "{\"k\":"),
            (
                "top_k regex",
                Sampling { top_k: 3, ..hot(seed) },
                Constraint::Regex("(yes|no|maybe)".into()),
                "m",
            ),
            (
                "a bias towards a refused token",
                Sampling {
                    logit_bias: vec![(u32::from(b'a'), 100.0), (2000, 100.0)],
                    ..Sampling::GREEDY
                },
                Constraint::Regex("[0-9]+x".into()),
                "7",
            ),
            (
                "sampled lark",
                hot(seed ^ 5),
                Constraint::Lark("start: \"x\" NUM\nNUM: /[0-9]+/".into()),
                "x",
            ),
            (
                "a json schema",
                hot(seed ^ 9),
                Constraint::JsonSchema(
                    r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}"#
                        .into(),
                ),
                "{\"n\":4",
            ),
            ("complete", hot(seed), Constraint::Regex("ok".into()), "ok"),
        ]
        };
    // with logprobs: (alternatives, every prompt position) per case
    let asked = [
        (5, false),
        (20, false),
        (0, false),
        (3, false),
        (2, true),
        (1, false),
        (4, false),
    ];
    let mut compared = 0;
    let mut picks_without: Vec<Vec<u32>> = Vec::new();
    for (seed, with_logprobs) in (0..16u64)
        .map(|s| (s, false))
        .chain((0..16u64).map(|s| (s, true)))
    {
        let batch: Vec<SeqInput> = cases(seed)
            .into_iter()
            .enumerate()
            .map(|(s, (_, sampling, grammar, output))| {
                let s = s as u32;
                let ids: Vec<u32> = (s * 4..(s + 1) * 4).collect();
                let mut tokens: Vec<u32> = (0..20)
                    .map(|i| (i * 37 + s * 13 + seed as u32 * 7) % vocab as u32)
                    .collect();
                tokens.extend(byte_level::encode(output, false));
                SeqInput {
                    seq_id: u64::from(s),
                    tokens,
                    start_pos: 0,
                    tables: windows.iter().map(|&w| table(w, 0, &ids)).collect(),
                    all_positions: false,
                    sampling: Sampling {
                        constrained: true,
                        prompt_len: 20,
                        ..sampling
                    },
                    copies: Vec::new(),
                    history: Some(Vec::new()),
                    logprobs: with_logprobs.then_some(LogprobsSpec {
                        top: asked[s as usize].0,
                        prompt: asked[s as usize].1,
                        next_prompt_token: None,
                    }),
                    grammar: Some(Ok(grammar)),
                }
            })
            .collect();
        let (on_host, on_device) = host_and_device(&mut worker, batch);
        let picks: Vec<u32> = on_device.iter().map(|o| o.next_token).collect();
        if with_logprobs {
            assert_eq!(
                picks, picks_without[seed as usize],
                "logprobs change no pick, seed {seed}"
            );
            for (i, (name, ..)) in cases(seed).into_iter().enumerate() {
                let (host, device) = (&on_host.seqs[i], &on_device[i]);
                let raw = on_host.logits(i);
                let rows = raw.len() / on_host.vocab();
                assert_eq!(device.logprobs.len(), rows, "{name}");
                assert_eq!(host.logprobs.len(), rows, "{name}");
                for (r, (d, h)) in device.logprobs.iter().zip(&host.logprobs).enumerate() {
                    // row r chooses the next input token, the last the pick
                    let row = &raw[r * on_host.vocab()..(r + 1) * on_host.vocab()];
                    let want = row_logprobs(row, h.token, asked[i].0 as usize);
                    assert_eq!(
                        h, &want,
                        "{name}, seed {seed}: the host's are of the raw row"
                    );
                    assert_logprobs_match(d, h, &format!("{name}, seed {seed}, row {r}"));
                }
                assert_eq!(device.logprobs[rows - 1].token, device.next_token, "{name}");
            }
        } else {
            picks_without.push(picks);
        }
        let grammars = match tokenizer.grammars() {
            Ok(g) => g,
            Err(e) => panic!("grammars: {e}"),
        };
        for (i, (name, _, grammar, output)) in cases(seed).into_iter().enumerate() {
            let t = on_device[i].next_token;
            assert_eq!(t, on_host.seqs[i].next_token, "{name}, seed {seed}");
            let mut m = match grammars.compile(&grammar) {
                Ok(m) => m,
                Err(e) => panic!("{name}: {e}"),
            };
            for tok in byte_level::encode(output, false) {
                if let Err(e) = m.consume(tok) {
                    panic!("{name}: {e}");
                }
            }
            let mut words = Vec::new();
            if let Err(e) = m.mask_into(&mut words, vocab) {
                panic!("{name}: {e}");
            }
            assert!(allowed(&words, t), "{name}, seed {seed}: {t} is refused");
            compared += 1;
        }
        assert_eq!(
            on_device[6].next_token,
            byte_level::EOS,
            "complete: the end"
        );
        assert_ne!(on_device[3].next_token, u32::from(b'a'), "a refused token");
    }
    println!("{compared} masked picks equal on the device and the host, half with raw logprobs");
}
