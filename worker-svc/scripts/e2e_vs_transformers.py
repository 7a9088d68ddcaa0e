#!/usr/bin/env python3
"""A real model end to end on one GPU: kvlease against Hugging Face transformers.

Runs, on the same machine and in one call:

1. a kvlease cluster (cache, one CUDA worker serving the GGUF, scheduler)
   driven by `kvlease bench` at concurrency N: prompts of P tokens (ids drawn
   from the byte range, unique per request, so no prefix is reused), exactly
   M output tokens each (end of sequence ignored), several waves of N;
2. transformers `generate` with a static cache in bf16 at batch N on prompts
   of the same length (ids from the same range), exactly M new tokens, after
   one warm-up call;

and prints both output-token rates, their ratio against the target (>= 2x),
and kvlease's step overhead: from the worker's log, the time between the ends
of two consecutive decode steps minus the compute of the second, over the
compute (target <= 10%).

The model is a GGUF file or a Hugging Face directory (--model). With
--make-llama-1b DIR, the script first writes a 1.1B Llama-shaped directory
there (22 layers, hidden 2048, 32/4 heads, ffn 5632, SmolLM2's vocabulary
and tokenizer, taken from --tokenizer; random bf16 weights, seeded):
nothing to download. With --prefixes N the prompts are N shared prefixes of
--prefix-tokens plus a unique tail of --prompt-tokens (transformers' static
cache is then skipped: it has no prefix reuse to compare with).

It also prints the median decode step of the measured run against its byte
limit: the bf16 weights plus the batch's KV at the median context, read once
at the copy bandwidth measured here (a device-to-device copy).

Needs: the release binaries kvlease, kvlease-cache, kvlease-scheduler and
kvlease-worker (built with `--features cuda`) in --bin-dir; PyTorch,
transformers and the `gguf` package importable (transformers reads the GGUF
through it; `pip install --no-deps --target DIR gguf` and PYTHONPATH=DIR).

    python3 worker-svc/scripts/e2e_vs_transformers.py --bin-dir DIR --model FILE_OR_DIR
"""

import json

import argparse
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
# 2026-12-01T10:16:21.003676Z ... forward done step=863 sequences=7 tokens=7 compute_us=3659
FORWARD_DONE = re.compile(
    r"^(\S+Z) .*forward done step=(\d+) sequences=(\d+) tokens=(\d+) compute_us=(\d+)"
)


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
                ts, step, seqs, toks, us = m.groups()
                steps.append((parse_ts(ts), int(step), int(seqs), int(toks), int(us) / 1e6))
    gaps, computes = [], []
    for prev, cur in zip(steps, steps[1:]):
        decode = cur[2] == cur[3] and cur[2] >= min_sequences
        if decode and cur[1] == prev[1] + 1:
            gaps.append(max(0.0, cur[0] - prev[0] - cur[4]))
            computes.append(cur[4])
    return gaps, computes


# ... between forward passes step=12 apply_us=80 settle_us=310 launch_us=40 launched=true
BETWEEN = re.compile(r"between forward passes step=\d+ apply_us=(\d+) settle_us=(\d+) launch_us=(\d+)")


def scheduler_side(scheduler_log):
    """Medians (us) of the scheduler's own work between two forward passes:
    applying the results and streaming them, the Step call to the cache
    (releases, completion, extends), planning and sending the next pass."""
    rows = []
    with open(scheduler_log, errors="replace") as f:
        for line in f:
            m = BETWEEN.search(ANSI.sub("", line))
            if m:
                rows.append(tuple(int(x) for x in m.groups()))
    if not rows:
        return None
    return tuple(statistics.median(r[i] for r in rows) for i in range(3)) + (len(rows),)


def run_kvlease(args, log_dir):
    kv = os.path.join(args.bin_dir, "kvlease")
    ports = {k: free_port() for k in ("scheduler", "cache", "worker")}
    env = dict(os.environ, RUST_LOG="info", NO_COLOR="1")
    procs = []

    def start(name, argv):
        log = open(os.path.join(log_dir, f"{name}.log"), "w")
        # the scheduler's debug line per step splits its side of the gap
        own = dict(env, RUST_LOG="info,scheduler_svc::step_loop=debug") if name == "scheduler" else env
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
            "--model", args.model, "--backend", "cuda",
            "--max-batch-sequences", str(args.concurrency),
            "--max-batch-tokens", str(max(4096, args.concurrency * prompt_len(args))),
        ])
        wait_healthy(kv, f"127.0.0.1:{ports['worker']}", worker, "worker")
        sched = start("scheduler", [
            os.path.join(args.bin_dir, "kvlease-scheduler"),
            "--listen", f"127.0.0.1:{ports['scheduler']}",
            "--cache-addr", f"http://127.0.0.1:{ports['cache']}",
            "--worker-addrs", f"http://127.0.0.1:{ports['worker']}",
            "--max-seqs", str(args.concurrency),
            "--max-tokens-per-step", str(max(2048, args.concurrency * prompt_len(args))),
            "--overlap", "true" if args.overlap else "false",
        ])
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
        return (float(m.group(2)), step_overhead(measured, args.concurrency // 2),
                scheduler_side(os.path.join(log_dir, "scheduler.log")))
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


def make_llama_1b(directory, tokenizer):
    """A 1.1B Llama-shaped model with random bf16 weights and the tokenizer of
    `tokenizer` (a GGUF file or a directory with tokenizer.json)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(directory, "config.json")):
        return
    tok = load_hf(tokenizer, AutoTokenizer, None)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(1)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


def byte_limit(model_dir_or_file, concurrency, context):
    """Seconds a decode step of `concurrency` sequences at `context` tokens
    must take at least: the bf16 weights and the KV read once at the copy
    bandwidth measured now; and that bandwidth (bytes/s)."""
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
    kv = 2 * concurrency * context * layers * 2 * kv_heads * head_dim
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--model", required=True, help="a GGUF file or a Hugging Face directory")
    ap.add_argument("--make-llama-1b", metavar="DIR",
                    help="write a random-weight 1.1B Llama directory to DIR first and serve it")
    ap.add_argument("--tokenizer", help="the tokenizer --make-llama-1b uses: SmolLM2's GGUF, "
                    "or a directory with its tokenizer.json")
    ap.add_argument("--prefixes", type=int, default=0, help="shared prompt prefixes (0: none)")
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--label", default="", help="a name for the run's lines")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=18)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=4, help="kvlease requests = waves x concurrency")
    ap.add_argument("--repeats", type=int, default=3, help="timed transformers calls (median)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="scheduler overlap mode (next step planned while a forward runs)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvlease-e2e-")
    os.makedirs(log_dir, exist_ok=True)

    if args.make_llama_1b:
        if not args.tokenizer:
            raise SystemExit("--make-llama-1b needs --tokenizer")
        make_llama_1b(args.make_llama_1b, args.tokenizer)
        args.model = args.make_llama_1b
    label = args.label or os.path.basename(args.model.rstrip("/"))
    kv_rate, (gaps, computes), sched = run_kvlease(args, log_dir)
    if args.prefixes or args.skip_transformers:
        hf_rate, torch_v, tf_v = None, None, None
    else:
        hf_rate, torch_v, tf_v = run_transformers(args)

    print(f"{label}: concurrency {args.concurrency}, "
          f"{f'{args.prefixes} shared {args.prefix_tokens}-token prefixes + ' if args.prefixes else ''}"
          f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, overlap {args.overlap}"
          f"{f'; torch {torch_v}, transformers {tf_v}' if torch_v else ''}")
    print(f"{'system':<44} {'output tok/s':>14}")
    if hf_rate:
        print(f"{'transformers generate (static cache, bf16)':<44} {hf_rate:>14.0f}")
    print(f"{'kvlease bench (cluster, CUDA worker)':<44} {kv_rate:>14.0f}")
    if hf_rate:
        print(f"ratio kvlease / transformers static: {kv_rate / hf_rate:.2f}")
    if computes:
        overhead = sum(gaps) / sum(computes)
        step = statistics.median(g + c for g, c in zip(gaps, computes))
        print(f"step overhead over {len(computes)} decode steps (>= {args.concurrency // 2} "
              f"sequences): median gap {1e3 * statistics.median(gaps):.3f} ms, median compute "
              f"{1e3 * statistics.median(computes):.3f} ms, median step {1e3 * step:.3f} ms, "
              f"total gap / compute {overhead:.3f} (target <= 0.10: "
              f"{'met' if overhead <= 0.10 else 'MISSED'})")
        # a decode step in the middle of the outputs
        context = prompt_len(args) + args.new_tokens // 2
        limit, bw, weights, kv, _ = byte_limit(args.model, args.concurrency, context)
        print(f"byte limit of a decode step of {args.concurrency} sequences at {context} tokens: "
              f"{weights / 1e9:.3f} GB weights + {kv / 1e9:.3f} GB KV at {bw / 1e9:.0f} GB/s "
              f"(copy) = {1e3 * limit:.3f} ms; median step / limit: {step / limit:.2f}x "
              f"(limit / step {limit / step:.2f}, target >= 0.5)")
    else:
        print("step overhead: no consecutive decode steps found in the worker's log")
    if sched:
        print(f"scheduler side between forward passes ({sched[3]} steps, all sizes), medians: "
              f"apply + stream {sched[0]:.0f} us, Step call {sched[1]:.0f} us, "
              f"plan + send {sched[2]:.0f} us; the rest of the gap is transport and the "
              f"worker outside its compute")
    print(f"logs: {log_dir}")


if __name__ == "__main__":
    sys.exit(main())
