#!/usr/bin/env python3
"""kvlease's CPU worker against llama.cpp on the same GGUF, side by side.

Installs llama-cpp-python 0.3.36 (built from source for this CPU, about 4+
minutes the first time) into a cached venv, builds kvlease's
`cpu_throughput` example in release, loads the model in both, and runs the
same workloads alternately (llama.cpp, then kvlease, per run), both on the
same number of threads:

  prefill512  one 512-token prompt, one forward pass (tokens/s)
  decode1     1 sequence holding a 128-token prompt, 64 decode steps
  decode16    16 such sequences, one token each per step (tokens/s in total)

It prints one table of medians: workload, llama.cpp tok/s, kvlease tok/s,
ratio, target (issue 11: prefill and 16-sequence decode at least llama.cpp's,
one-sequence decode at least half of it) and whether it is met.

Usage: worker-svc/scripts/cpu_vs_llamacpp.py [--model GGUF] [--threads 2] [--runs 5]
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

LLAMACPP_VERSION = "0.3.36"
PREFILL_LEN = 512
DECODE_CONTEXT = 128
DECODE_STEPS = 64
# workload -> (sequences, target as a share of llama.cpp's rate)
WORKLOADS = {"prefill512": (1, 1.0), "decode1": (1, 0.5), "decode16": (16, 1.0)}
REPO = pathlib.Path(__file__).resolve().parents[2]


def default_model():
    """Where `kvlease model fetch smollm2` puts it: $KVLEASE_HOME, else
    ~/.cache/kvlease/models."""
    models = os.environ.get("KVLEASE_HOME") or pathlib.Path.home() / ".cache/kvlease/models"
    return pathlib.Path(models) / "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_llamacpp():
    """The cached venv's python, with llama-cpp-python installed."""
    venv = pathlib.Path.home() / f".cache/kvlease/llamacpp-{LLAMACPP_VERSION}"
    python = venv / "bin/python"
    check = [str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"]
    if python.exists():
        got = subprocess.run(check, capture_output=True, text=True)
        if got.returncode == 0 and got.stdout.strip() == LLAMACPP_VERSION:
            return python
    print(f"installing llama-cpp-python {LLAMACPP_VERSION} into {venv} "
          "(builds llama.cpp for this CPU: several minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON")
    subprocess.run([str(python), "-m", "pip", "install", f"llama-cpp-python=={LLAMACPP_VERSION}"],
                   check=True, env=env)
    return python


def build_kvlease():
    subprocess.run(["cargo", "build", "--release", "-p", "worker-svc", "--example", "cpu_throughput"],
                   check=True, cwd=REPO)
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return target / "release/examples/cpu_throughput"


class Kvlease:
    """The example binary, fed one workload per line."""

    def __init__(self, binary, model, threads):
        self.proc = subprocess.Popen([str(binary), str(model), str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline().strip()
        if not ready.startswith("ready"):
            sys.exit(f"kvlease cpu_throughput did not start: {ready!r}")
        self.banner = ready

    def run(self, workload):
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        name, tps = self.proc.stdout.readline().split()
        assert name == workload, (name, workload)
        return float(tps)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API, in this process."""

    def __init__(self, model, threads):
        import ctypes
        import llama_cpp as L
        self.L = L
        # Quiet: llama.cpp logs every graph it reserves.
        self._log = L.llama_log_callback(lambda level, text, data: None)
        L.llama_log_set(self._log, ctypes.c_void_p())
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        # No extra buffer types: on CPUs with AMX, llama.cpp built for the
        # native CPU moves Q4_1/Q8_0 matrices into AMX buffers, whose
        # product segfaults in ggml_backend_amx_mul_mat where the kernel
        # (here a VM's) does not grant the AMX tile state. Its AVX-512/VNNI
        # kernels still run (the Q8 activations x Q4 weights dot products).
        mparams.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(str(model).encode(), mparams)
        if not self.model:
            sys.exit(f"llama.cpp cannot load {model}")
        cparams = L.llama_context_default_params()
        # Per-sequence KV streams (llama.cpp's default, its faster choice for
        # unrelated sequences), each long enough for the 512-token prompt.
        cparams.n_ctx = 16 * PREFILL_LEN
        cparams.n_batch = PREFILL_LEN
        cparams.n_ubatch = PREFILL_LEN
        cparams.n_seq_max = 16
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            sys.exit("llama.cpp cannot create a context")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(PREFILL_LEN, 0, 16)

    def _decode(self, entries):
        """entries: (token, pos, seq, wants_logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            sys.exit(f"llama_decode returned {rc}")
        self.L.llama_synchronize(self.ctx)

    def _tokens(self, seq, start, end, salt):
        # The same ids kvlease's harness feeds (worker-svc/src/throughput.rs).
        return [((p * 7919 + seq * 104729 + salt * 31) % self.vocab) for p in range(start, end)]

    def _clear(self):
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def run(self, workload, salt):
        self._clear()
        if workload == "prefill512":
            toks = self._tokens(0, 0, PREFILL_LEN, salt)
            entries = [(t, p, 0, p == PREFILL_LEN - 1) for p, t in enumerate(toks)]
            started = time.perf_counter()
            self._decode(entries)
            return PREFILL_LEN / (time.perf_counter() - started)
        seqs = WORKLOADS[workload][0]
        for s in range(seqs):
            toks = self._tokens(s, 0, DECODE_CONTEXT, 0)
            self._decode([(t, p, s, p == DECODE_CONTEXT - 1) for p, t in enumerate(toks)])
        total = 0.0
        for step in range(DECODE_STEPS):
            pos = DECODE_CONTEXT + step
            entries = [(self._tokens(s, pos, pos + 1, 0)[0], pos, s, True) for s in range(seqs)]
            started = time.perf_counter()
            self._decode(entries)
            total += time.perf_counter() - started
        return seqs * DECODE_STEPS / total


def inner(args):
    """Runs inside the llama.cpp venv."""
    kv = Kvlease(args.binary, args.model, args.threads)
    ll = LlamaCpp(args.model, args.threads)
    results = {w: ([], []) for w in WORKLOADS}
    for run in range(args.runs):
        for w in WORKLOADS:
            results[w][0].append(ll.run(w, run + 1))
            results[w][1].append(kv.run(w))
        print(f"run {run + 1}/{args.runs}: " + ", ".join(
            f"{w} {results[w][0][-1]:.1f} vs {results[w][1][-1]:.1f}" for w in WORKLOADS),
            file=sys.stderr, flush=True)
    kv.close()
    load = os.getloadavg()
    print(f"model: {args.model}")
    print(f"kvlease: {kv.banner}; llama.cpp: llama-cpp-python {LLAMACPP_VERSION} "
          f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, no extra buffer types); "
          f"{args.threads} threads each; medians of {args.runs} alternating runs")
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"({os.cpu_count()} CPUs)")
    print()
    print("| workload | llama.cpp tok/s | kvlease tok/s | ratio | target | met? |")
    print("|---|---:|---:|---:|---|---|")
    for w, (_, share) in WORKLOADS.items():
        ll_med = statistics.median(results[w][0])
        kv_med = statistics.median(results[w][1])
        ratio = kv_med / ll_med
        target = ">= llama.cpp" if share == 1.0 else f">= {share:g} x llama.cpp"
        print(f"| {w} | {ll_med:.1f} | {kv_med:.1f} | {ratio:.2f} | {target} | "
              f"{'yes' if ratio >= share else 'no'} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=pathlib.Path, default=default_model())
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--binary", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        return inner(args)
    if not args.model.is_file():
        sys.exit(f"{args.model} is missing: run `kvlease model fetch smollm2` first")
    python = ensure_llamacpp()
    binary = build_kvlease()
    cmd = [str(python), __file__, "--inner", "--binary", str(binary), "--model", str(args.model),
           "--threads", str(args.threads), "--runs", str(args.runs)]
    # llama.cpp's threads meet at OpenMP barriers. Spinning there (libgomp's
    # default) is its faster choice on idle cores, but on cores shared with
    # other work it collapses (seen: one-sequence decode at 0.4 tok/s spinning
    # vs 18 passive, load average 15 on 2 cores). Passive unless the caller
    # chose: pass OMP_WAIT_POLICY=ACTIVE on a quiet machine.
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
