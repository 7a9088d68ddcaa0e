"""kvlease against Hugging Face transformers, end to end on one GPU: the table of record.

For each model (--model, repeatable: a GGUF file or a Hugging Face directory;
--make-llama-1b DIR adds a 1.1B Llama-shaped directory written there: 22
layers, hidden 2048, 32/4 heads, ffn 5632, SmolLM2's vocabulary and
tokenizer from --tokenizer, random bf16 weights, seeded; nothing to
download; --make-smollm2-shape DIR likewise SmolLM2-135M's shape, 30
layers, hidden 576, 9/3 heads, ffn 1536, tied embeddings: for comparing
speed without moving the GGUF's 98 MB to the machine)
and each workload (--workload, default all three):

- 18/128: unique 18-token prompts, exactly 128 new tokens;
- 512/128: unique 512-token prompts, 128 new;
- shared: 8 shared 1,024-token prefixes plus 32 own tokens, 64 new;

it runs, in one call on the same machine:

1. a kvlease cluster (cache, one CUDA worker, scheduler) driven by
   `kvlease bench` at concurrency N (default 256), --waves x N requests after
   a warm-up wave on other prompts (so nothing measured reuses a warm-up
   prefix); token ids from the byte range, end of sequence ignored;
2. transformers `generate` with a static cache in bf16 at batch N (not for
   shared prefixes: it has no prefix reuse), after one warm-up call;
3. transformers continuous batching (`generate_batch`, paged KV, at most N
   requests a batch) on --cb-requests prompts of the same shape;

and prints one row per model and workload: the three output-token rates,
kvlease's ratios to both, the median decode step against its byte limit
(the bf16 weights plus the batch's KV at the median context, read once at
the copy bandwidth measured in the run), the step overhead (from the
worker's log: the time between the ends of two consecutive decode steps
minus the compute of the second, over the compute), and TTFT p50. Under
the table, where the gap goes: the scheduler's work between passes, the
worker's wait from a Forward's arrival to its pass, and the rest of the
round trip (both messages encoded, sent and decoded).

With --results FILE each row is also appended to FILE (JSON lines) and the
table shows every row in it, so a lease's runs split over several calls
(a device call has a time limit) still print one table;
--print-table only prints it.

Needs: the release binaries kvlease, kvlease-cache, kvlease-scheduler and
kvlease-worker (built with `--features cuda`) in --bin-dir; PyTorch,
transformers and the `gguf` package importable (transformers reads the GGUF
through it; `pip install --no-deps --target DIR gguf` and PYTHONPATH=DIR).

    python3 worker-svc/scripts/e2e_vs_transformers.py --bin-dir DIR \\
        --model SMOLLM2.gguf --make-llama-1b /tmp/llama-1b --tokenizer SMOLLM2.gguf
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(kvlease, addr, proc, name, timeout_s=300):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode} before it was healthy")
        r = subprocess.run([kvlease, "health", addr], capture_output=True, text=True)
        if r.returncode == 0:
            return
        time.sleep(0.5)
    raise SystemExit(f"{name} at {addr} not healthy after {timeout_s} s")


ANSI = re.compile(r"\x1b\[[0-9;]*m")
# 2026-12-01T10:16:21.003676Z ... forward done step=863 sequences=7 tokens=7 compute_us=3659 wait_us=85
FORWARD_DONE = re.compile(
    r"^(\S+Z) .*forward done step=(\d+) sequences=(\d+) tokens=(\d+) compute_us=(\d+)"
    r"(?: wait_us=(\d+))?"
)
# ... forward answered step=863 group=0 round_trip_us=4100
ANSWERED = re.compile(r"forward answered step=(\d+) group=\d+ round_trip_us=(\d+)")


def parse_ts(ts):
    # seconds since midnight with microseconds; runs never cross midnight by much
    hms = ts.split("T")[1].rstrip("Z")
    h, m, s = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def step_overhead(worker_log, min_sequences):
    """Decode steps (one token per sequence, at least min_sequences) whose
    predecessor was also a forward: gap = end(i) - end(i-1) - compute(i)."""
    steps = []
    with open(worker_log, errors="replace") as f:
        for line in f:
            m = FORWARD_DONE.search(ANSI.sub("", line))
            if m:
                ts, step, seqs, toks, us, wait = m.groups()
                steps.append((parse_ts(ts), int(step), int(seqs), int(toks), int(us) / 1e6,
                              int(wait or 0) / 1e6))
    gaps, computes, waits = [], [], {}
    for prev, cur in zip(steps, steps[1:]):
        decode = cur[2] == cur[3] and cur[2] >= min_sequences
        if decode and cur[1] == prev[1] + 1:
            gaps.append(max(0.0, cur[0] - prev[0] - cur[4]))
            computes.append(cur[4])
            waits[cur[1]] = (cur[4], cur[5])
    return gaps, computes, waits


def transport(scheduler_log, waits):
    """Medians (us), over the decode steps `step_overhead` kept, of the
    worker's wait from the Forward's arrival at its handler to the pass's
    start, and of the round trip the scheduler saw minus that wait and the
    compute: both messages' encoding, transport and decoding."""
    if not waits:
        return None
    worker_wait, rest = [], []
    with open(scheduler_log, errors="replace") as f:
        for line in f:
            m = ANSWERED.search(ANSI.sub("", line))
            if m and int(m.group(1)) in waits:
                compute, wait = waits[int(m.group(1))]
                worker_wait.append(wait * 1e6)
                rest.append(int(m.group(2)) - (compute + wait) * 1e6)
    if not rest:
        return None
    return statistics.median(worker_wait), statistics.median(rest), len(rest)


# ... between forward passes step=12 apply_us=80 settle_us=310 launch_us=40 launched=true
BETWEEN = re.compile(r"between forward passes step=\d+ apply_us=(\d+) settle_us=(\d+) launch_us=(\d+)")


# ... settled after the launch step=12 settle_us=300 turn_us=120 waited_us=0
# (no waited_us: a scheduler that waited for the call's answer before its turn ended)
SETTLED = re.compile(r"settled after the launch step=\d+ settle_us=(\d+) turn_us=(\d+)(?: waited_us=(\d+))?")


def scheduler_side(scheduler_log, since=0):
    """Medians (us) of the scheduler's own work between two forward passes:
    applying the results (and, in the plain order, streaming them), the Step call to the cache
    (releases, completion, extends) before the launch, planning and sending
    the next pass; then, where the settle follows the launch, that Step
    call (its answer is applied once the next pass is back), the loop's
    turn (answer in to that call sent: the most steps a second the loop can
    make, whatever the pipeline's depth) and how long the loop then still
    waited for the call's answer once the next pass was back; from byte
    `since` of the log on (the measured run, not the warm-up)."""
    rows, settles = [], []
    with open(scheduler_log, errors="replace") as f:
        f.seek(since)
        for line in f:
            line = ANSI.sub("", line)
            m = BETWEEN.search(line)
            if m:
                rows.append(tuple(int(x) for x in m.groups()))
            m = SETTLED.search(line)
            if m:
                settles.append(tuple(int(x or 0) for x in m.groups()))
    if not rows:
        return None
    after = tuple(statistics.median(r[i] for r in settles) for i in range(3)) if settles \
        else (None, None, None)
    return tuple(statistics.median(r[i] for r in rows) for i in range(3)) + after + (len(rows),)


def run_kvlease(args, log_dir):
    kv = os.path.join(args.bin_dir, "kvlease")
    ports = {k: free_port() for k in ("scheduler", "cache", "worker")}
    env = dict(os.environ, RUST_LOG="info", NO_COLOR="1")
    procs = []

    def start(name, argv):
        log = open(os.path.join(log_dir, f"{name}.log"), "w")
        # the scheduler's and the worker's debug lines per step split the gap
        filters = {
            "scheduler": "info,scheduler_svc::step_loop=debug",
            "worker": "info,worker_svc::service=debug",
        }
        own = dict(env, RUST_LOG=filters[name]) if name in filters else env
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=own)
        procs.append(p)
        return p

    try:
        cache = start("cache", [os.path.join(args.bin_dir, "kvlease-cache"),
                                "--listen", f"127.0.0.1:{ports['cache']}"])
        wait_healthy(kv, f"127.0.0.1:{ports['cache']}", cache, "cache")
        worker = start("worker", [
            os.path.join(args.bin_dir, "kvlease-worker"),
            "--listen", f"127.0.0.1:{ports['worker']}",
            "--model", args.model, "--backend", args.backend, "--kv-dtype", args.kv_dtype,
            "--max-batch-sequences", str(args.concurrency),
            "--max-batch-tokens", str(max(4096, args.concurrency * prompt_len(args))),
        # the CPU backend counts activations for that batch in its budget
        # (the device sizes its arena from the memory it finds)
        ] + (["--memory-budget-mib", str(args.cpu_memory_mib)] if args.backend == "cpu" else []))
        wait_healthy(kv, f"127.0.0.1:{ports['worker']}", worker, "worker")
        sched = start("scheduler", [
            os.path.join(args.bin_dir, "kvlease-scheduler"),
            "--listen", f"127.0.0.1:{ports['scheduler']}",
            "--cache-addr", f"http://127.0.0.1:{ports['cache']}",
            "--worker-addrs", f"http://127.0.0.1:{ports['worker']}",
            "--max-seqs", str(args.concurrency),
            "--max-tokens-per-step", str(max(2048, args.concurrency * prompt_len(args))),
            "--overlap", "true" if args.overlap else "false",
        ] + (["--pipeline-depth", str(args.pipeline_depth)] if args.pipeline_depth else []))
        wait_healthy(kv, f"127.0.0.1:{ports['scheduler']}", sched, "scheduler")
        bench = [kv, "bench", "--scheduler", f"127.0.0.1:{ports['scheduler']}",
                 "--requests", str(args.concurrency * args.waves),
                 "--concurrency", str(args.concurrency),
                 "--prefixes", str(args.prefixes),
                 "--prefix-tokens", str(args.prefix_tokens if args.prefixes else 0),
                 "--tail-min", str(args.prompt_tokens), "--tail-max", str(args.prompt_tokens),
                 "--output-min", str(args.new_tokens), "--output-max", str(args.new_tokens),
                 "--no-progress", "--fail-on-error"]
        # one warm-up wave (kernels, allocator) on other prompts (another
        # seed), so the measured run reuses no cached prefix; then the
        # measured run
        subprocess.run(bench[:4] + ["--requests", str(args.concurrency)] + bench[6:]
                       + ["--seed", "2"], capture_output=True, text=True, check=True)
        mark = os.path.getsize(os.path.join(log_dir, "worker.log"))
        sched_mark = os.path.getsize(os.path.join(log_dir, "scheduler.log"))
        r = subprocess.run(bench, capture_output=True, text=True)
        print(r.stdout)
        if r.returncode != 0:
            print(r.stderr)
            raise SystemExit("kvlease bench failed")
        m = re.search(r"throughput\s+([\d.]+) req/s, ([\d.]+) output tok/s", r.stdout)
        if not m:
            raise SystemExit("no throughput line in kvlease bench's output")
        # the measured run's part of the worker log
        with open(os.path.join(log_dir, "worker.log"), errors="replace") as f:
            f.seek(mark)
            tail = f.read()
        measured = os.path.join(log_dir, "worker.measured.log")
        with open(measured, "w") as f:
            f.write(tail)
        gaps, computes, waits = step_overhead(measured, args.concurrency // 2)
        scheduler_log = os.path.join(log_dir, "scheduler.log")
        ttft = re.search(r"TTFT\s+p50 ([\d.]+) ?ms", r.stdout)
        return (float(m.group(2)), (gaps, computes), scheduler_side(scheduler_log, sched_mark),
                transport(scheduler_log, waits), ttft and float(ttft.group(1)))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def prompt_len(args):
    return args.prompt_tokens + (args.prefix_tokens if args.prefixes else 0)


def load_hf(model, cls, dtype):
    """A transformers object (model or tokenizer) from a GGUF file or a directory."""
    if os.path.isdir(model):
        return cls.from_pretrained(model, dtype=dtype) if dtype else cls.from_pretrained(model)
    directory, name = os.path.split(os.path.abspath(model))
    if dtype:
        return cls.from_pretrained(directory, gguf_file=name, dtype=dtype)
    return cls.from_pretrained(directory, gguf_file=name)


# Llama shapes --make-llama-1b and --make-smollm2-shape write (SmolLM2's
# vocabulary either way).
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                     rope_theta=10000.0, tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True),
}


def make_llama(directory, tokenizer, shape):
    """A Llama model of `SHAPES[shape]` with random bf16 weights and the
    tokenizer of `tokenizer` (a GGUF file or a directory with tokenizer.json)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(directory, "config.json")):
        return
    tok = load_hf(tokenizer, AutoTokenizer, None)
    config = LlamaConfig(
        vocab_size=49152, rms_norm_eps=1e-5, **SHAPES[shape],
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(1)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


def byte_limit(model_dir_or_file, concurrency, context, kv_elem_bytes=2):
    """Seconds a decode step of `concurrency` sequences at `context` tokens
    must take at least: the bf16 weights and the KV (elements of
    `kv_elem_bytes`) read once at the copy bandwidth measured now; and that
    bandwidth (bytes/s)."""
    import torch
    from transformers import AutoConfig

    if os.path.isdir(model_dir_or_file):
        cfg = AutoConfig.from_pretrained(model_dir_or_file)
    else:
        directory, name = os.path.split(os.path.abspath(model_dir_or_file))
        cfg = AutoConfig.from_pretrained(directory, gguf_file=name)
    h, layers, ffn, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    per_layer = h * (heads * head_dim) * 2 + h * (kv_heads * head_dim) * 2 + 3 * h * ffn + 2 * h
    tied = getattr(cfg, "tie_word_embeddings", False)
    # the embedding rows read are few; the output projection is read whole
    weights = 2 * (layers * per_layer + vocab * h + h)
    kv = kv_elem_bytes * concurrency * context * layers * 2 * kv_heads * head_dim
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    # a copy reads and writes each byte
    bandwidth = 2 * 10 * src.numel() / (time.perf_counter() - t)
    del src, dst
    return (weights + kv) / bandwidth, bandwidth, weights, kv, tied


def run_transformers(args):
    import torch
    from transformers import AutoModelForCausalLM

    model = load_hf(args.model, AutoModelForCausalLM, torch.bfloat16).to("cuda").eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (args.concurrency, args.prompt_tokens), generator=gen).to("cuda")
    mask = torch.ones_like(ids)

    def once():
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False,
            max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
            cache_implementation="static", pad_token_id=0,
        )
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        new = (out.shape[1] - args.prompt_tokens) * out.shape[0]
        return new / elapsed

    once()  # warm-up (static cache allocation, kernels)
    rates = [once() for _ in range(args.repeats)]
    return statistics.median(rates), torch.__version__, __import__("transformers").__version__


WORKLOADS = {
    # name: (shared prefixes, prefix tokens, own prompt tokens, new tokens)
    "18/128": (0, 0, 18, 128),
    "512/128": (0, 0, 512, 128),
    "shared": (8, 1024, 32, 64),
}


def run_continuous_batching(args):
    """transformers' continuous batching (`generate_batch`, paged KV) on
    `--cb-requests` prompts shaped like the workload's (shared prefixes
    included), at most `--concurrency` per batch; output tok/s after a
    warm-up call on other prompts."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig

    model = None
    for attn in ("sdpa_paged", "paged|sdpa", None):
        try:
            kw = {"attn_implementation": attn} if attn else {}
            if os.path.isdir(args.model):
                model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, **kw)
            else:
                d, n = os.path.split(os.path.abspath(args.model))
                model = AutoModelForCausalLM.from_pretrained(d, gguf_file=n, dtype=torch.bfloat16, **kw)
            break
        except (ValueError, ImportError, KeyError) as e:
            print(f"continuous batching: attention {attn!r} not available ({e})")
    model = model.to("cuda").eval()
    gen = torch.Generator().manual_seed(3)

    def prompts(n, seed):
        g = torch.Generator().manual_seed(seed)
        prefixes = [torch.randint(1, 256, (args.prefix_tokens,), generator=gen).tolist()
                    for _ in range(args.prefixes)]
        out = []
        for i in range(n):
            own = torch.randint(1, 256, (args.prompt_tokens,), generator=g).tolist()
            out.append((prefixes[i % len(prefixes)] if prefixes else []) + own)
        return out

    config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.concurrency)

    def once(inputs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate_batch(inputs=inputs, generation_config=config,
                                   continuous_batching_config=cb, progress_bar=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        return sum(len(o.generated_tokens) for o in out.values()) / elapsed

    once(prompts(min(32, args.cb_requests), 11))
    rate = once(prompts(args.cb_requests, 12))
    del model
    torch.cuda.empty_cache()
    return rate


def one_row(args, log_dir, workload):
    """Runs one model on one workload: kvlease (once per --pipeline-depth
    given, in that order), then transformers once (static cache unless
    prompts share prefixes, continuous batching unless skipped); returns
    one row of figures per kvlease run, each with the same baselines."""
    baselines = {}
    rows = []
    # the scheduler ignores the depth without overlap
    depths = (args.pipeline_depth if args.overlap else None) or [None]
    for i, depth in enumerate(depths):
        run = argparse.Namespace(**vars(args))
        run.pipeline_depth = depth
        # each run's logs of its own (a depth may come twice: 2,3,2,3)
        own = os.path.join(log_dir, f"depth-{depth}-{i}") if depth else log_dir
        os.makedirs(own, exist_ok=True)
        rows.append(kvlease_row(run, own, workload))
    if not args.skip_transformers and not args.prefixes:
        baselines["static"] = run_transformers(args)[0]
    if not args.skip_transformers and not args.skip_continuous_batching:
        try:
            baselines["continuous"] = run_continuous_batching(args)
        except Exception as e:  # the row keeps kvlease's figures; the cell says why it is empty
            print(f"continuous batching failed: {type(e).__name__}: {e}", flush=True)
            baselines["continuous_error"] = f"{type(e).__name__}: {e}"
    for row in rows:
        row.update(baselines)
    return rows


def kvlease_row(args, log_dir, workload):
    """One kvlease run of one model on one workload: its row of figures."""
    label = args.label or os.path.basename(args.model.rstrip("/"))
    if args.kv_dtype != "bf16":
        label += f" ({args.kv_dtype} KV)"
    if args.pipeline_depth:
        label += f" (depth {args.pipeline_depth})"
    kv_rate, (gaps, computes), sched, wire, ttft = run_kvlease(args, log_dir)
    row = {"model": label, "workload": workload, "kvlease": kv_rate, "ttft_p50_ms": ttft,
           "overlap": args.overlap, "pipeline_depth": args.pipeline_depth}
    if computes:
        step = statistics.median(g + c for g, c in zip(gaps, computes))
        row.update(steps=len(computes), step_ms=1e3 * step,
                   gap_ms=1e3 * statistics.median(gaps),
                   compute_ms=1e3 * statistics.median(computes),
                   overhead=sum(gaps) / sum(computes))
        if args.backend == "cuda":
            # a decode step in the middle of the outputs
            context = prompt_len(args) + args.new_tokens // 2
            limit, bw, weights, kv, _ = byte_limit(args.model, args.concurrency, context,
                                                   1 if args.kv_dtype == "fp8" else 2)
            row.update(limit_ms=1e3 * limit, bandwidth_gbs=bw / 1e9,
                       weights_gb=weights / 1e9, kv_gb=kv / 1e9)
    if sched:
        row.update(apply_us=sched[0], settle_us=sched[1], launch_us=sched[2],
                   settle_after_us=sched[3], loop_turn_us=sched[4], settle_waited_us=sched[5])
    if wire:
        row.update(worker_wait_us=wire[0], wire_us=wire[1])
    return row


def fmt(v, spec):
    return format(v, spec) if v is not None else "-"


def print_table(rows):
    """The table of record: one row per model and workload, ratios against
    each transformers baseline measured in the same run."""
    print("| model | workload | transformers static | transformers continuous batching | "
          "kvlease | / static | / continuous | median step | byte limit / step | "
          "gap / compute | TTFT p50 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        kv, st, cb = r["kvlease"], r.get("static"), r.get("continuous")
        step, limit = r.get("step_ms"), r.get("limit_ms")
        print(f"| {r['model']} | {r['workload']} | {fmt(st, ',.0f')} | {fmt(cb, ',.0f')} | "
              f"{kv:,.0f} | {fmt(st and kv / st, '.2f')}x | {fmt(cb and kv / cb, '.1f')}x | "
              f"{fmt(step, '.3f')} ms | {fmt(limit and step and limit / step, '.2f')} | "
              f"{fmt(r.get('overhead'), '.3f')} | {fmt(r.get('ttft_p50_ms'), '.1f')} ms |")
    print()
    for r in rows:
        parts = []
        if r.get("limit_ms"):
            parts.append(f"byte limit {r['limit_ms']:.3f} ms ({r['weights_gb']:.3f} GB weights + "
                         f"{r['kv_gb']:.3f} GB KV at {r['bandwidth_gbs']:.0f} GB/s)")
        if r.get("gap_ms") is not None:
            parts.append(f"median gap {r['gap_ms']:.3f} ms, compute {r['compute_ms']:.3f} ms "
                         f"over {r['steps']} decode steps")
        if r.get("apply_us") is not None:
            parts.append(f"scheduler: apply {r['apply_us']:.0f} us, Step call "
                         f"{r['settle_us']:.0f} us, plan + send {r['launch_us']:.0f} us")
        if r.get("loop_turn_us") is not None:
            parts.append(f"Step call after the launch {r['settle_after_us']:.0f} us, "
                         f"the loop's turn (answer in to that call sent) {r['loop_turn_us']:.0f} us, "
                         f"then waited for its answer {r.get('settle_waited_us') or 0:.0f} us")
        if r.get("wire_us") is not None:
            parts.append(f"worker: arrival to pass start {r['worker_wait_us']:.0f} us; "
                         f"round trip minus that and compute {r['wire_us']:.0f} us")
        print(f"- {r['model']} {r['workload']}: " + "; ".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir")
    ap.add_argument("--model", action="append", default=[],
                    help="a GGUF file or a Hugging Face directory (repeat for several)")
    ap.add_argument("--make-llama-1b", metavar="DIR",
                    help="write a random-weight 1.1B Llama directory to DIR first and serve it too")
    ap.add_argument("--make-smollm2-shape", metavar="DIR",
                    help="write a random-weight model of SmolLM2-135M's shape to DIR first and "
                    "serve it too")
    ap.add_argument("--tokenizer", help="the tokenizer --make-llama-1b and --make-smollm2-shape "
                    "use: SmolLM2's GGUF, or a directory with its tokenizer.json")
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                    help="the workloads to run (repeat; default: all three): 18/128 and "
                    "512/128 are unique prompts of that many tokens and new tokens; shared is "
                    "8 shared 1,024-token prefixes plus 32 own tokens, 64 new")
    ap.add_argument("--label", default="", help="a name for the run's lines (one model only)")
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "f16", "fp8"],
                    help="the worker's KV arena type (named in the rows' model column unless bf16)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--waves", type=int, default=4, help="kvlease requests = waves x concurrency")
    ap.add_argument("--repeats", type=int, default=3, help="timed transformers calls (median)")
    ap.add_argument("--cb-requests", type=int, default=256,
                    help="requests of the continuous-batching run (it is slow)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="scheduler overlap mode (next step planned while a forward runs)")
    ap.add_argument("--pipeline-depth", type=lambda v: [int(d) for d in v.split(",")],
                    default=None,
                    help="the scheduler's --pipeline-depth (passes in flight), or several "
                    "comma-separated (2,3,2,3: an A/B in one lease, transformers run once): "
                    "one kvlease run and row each, named in the model column")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-continuous-batching", action="store_true")
    ap.add_argument("--cpu-memory-mib", type=int, default=4096,
                    help="the worker's memory budget with --backend cpu")
    ap.add_argument("--backend", default="cuda", help="the worker's backend (cpu: try the "
                    "script's kvlease side on a machine without a GPU)")
    ap.add_argument("--results", help="append each row to this JSON-lines file, and print the "
                    "table of every row in it (rows of earlier calls in the same lease too)")
    ap.add_argument("--print-table", action="store_true",
                    help="only print the table of the rows in --results")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()

    def saved_rows():
        if not args.results or not os.path.exists(args.results):
            return []
        with open(args.results) as f:
            return [json.loads(line) for line in f if line.strip()]

    if args.print_table:
        print_table(saved_rows())
        return 0
    if not args.bin_dir:
        raise SystemExit("--bin-dir is needed to run kvlease")
    models = list(args.model)
    for shape, directory in (("smollm2", args.make_smollm2_shape), ("llama-1b", args.make_llama_1b)):
        if not directory:
            continue
        if not args.tokenizer:
            raise SystemExit("--make-llama-1b and --make-smollm2-shape need --tokenizer")
        make_llama(directory, args.tokenizer, shape)
        models.append(directory)
    if not models:
        raise SystemExit("no model: give --model, --make-llama-1b or --make-smollm2-shape")
    log_root = args.log_dir or tempfile.mkdtemp(prefix="kvlease-e2e-")
    rows = []
    for model in models:
        for workload in args.workload or list(WORKLOADS):
            run = argparse.Namespace(**vars(args))
            run.model = model
            run.prefixes, run.prefix_tokens, run.prompt_tokens, run.new_tokens = WORKLOADS[workload]
            log_dir = os.path.join(log_root, f"{os.path.basename(model.rstrip('/'))}-"
                                             f"{workload.replace('/', '-')}")
            os.makedirs(log_dir, exist_ok=True)
            for row in one_row(run, log_dir, workload):
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.results:
                    with open(args.results, "a") as f:
                        f.write(json.dumps(row) + "\n")
    if torch_versions := transformers_versions(args):
        print(torch_versions)
    print_table(saved_rows() if args.results else rows)
    print(f"logs: {log_root}")
    return 0


def transformers_versions(args):
    if args.skip_transformers:
        return None
    import torch
    import transformers
    return f"torch {torch.__version__}, transformers {transformers.__version__}"


if __name__ == "__main__":
    sys.exit(main())
