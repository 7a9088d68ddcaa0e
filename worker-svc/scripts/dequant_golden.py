#!/usr/bin/env python3
"""Golden dequantization values for worker-svc's GGUF reader.

For each GGML type the reader supports, draws random raw blocks (with finite,
moderate f16 scales where the type has them), dequantizes them with the
`gguf` package's `gguf.quants.dequantize` (the Python reference that ships
with llama.cpp) and writes bytes and values to
worker-svc/tests/data/dequant_golden.json.

    pip install gguf numpy && python3 worker-svc/scripts/dequant_golden.py
"""

import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "dequant_golden.json"
rng = np.random.default_rng(11)


def f16(values):
    return np.asarray(values, dtype=np.float16).tobytes()


def blocks(n, make):
    return b"".join(make() for _ in range(n))


def scale():
    return rng.uniform(-0.05, 0.05)


def raw(n):
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


CASES = {
    "f32": (T.F32, rng.standard_normal(16).astype(np.float32).tobytes()),
    "f16": (T.F16, f16(rng.standard_normal(16))),
    "bf16": (T.BF16, (rng.standard_normal(16).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()),
    "q4_0": (T.Q4_0, blocks(2, lambda: f16([scale()]) + raw(16))),
    "q4_1": (T.Q4_1, blocks(2, lambda: f16([scale(), scale()]) + raw(16))),
    "q8_0": (T.Q8_0, blocks(2, lambda: f16([scale()]) + raw(32))),
    "q4_k": (T.Q4_K, blocks(2, lambda: f16([scale(), scale()]) + raw(12) + raw(128))),
    "q6_k": (T.Q6_K, blocks(2, lambda: raw(128) + raw(64) + raw(16) + f16([scale()]))),
    # Added with issue 24, after the others so that their draws stay the same.
    "q5_0": (T.Q5_0, blocks(2, lambda: f16([scale()]) + raw(4) + raw(16))),
    "q5_1": (T.Q5_1, blocks(2, lambda: f16([scale(), scale()]) + raw(4) + raw(16))),
    "q2_k": (T.Q2_K, blocks(2, lambda: raw(16) + raw(64) + f16([scale(), scale()]))),
    "q3_k": (T.Q3_K, blocks(2, lambda: raw(32) + raw(64) + raw(12) + f16([scale()]))),
    "q5_k": (T.Q5_K, blocks(2, lambda: f16([scale(), scale()]) + raw(12) + raw(32) + raw(128))),
}

out = {}
for name, (ty, data) in CASES.items():
    values = dequantize(np.frombuffer(data, dtype=np.uint8), ty).astype(np.float32).reshape(-1)
    out[name] = {"type_id": int(ty), "bytes": data.hex(), "values": [float(v) for v in values]}
    print(f"{name}: {len(data)} bytes -> {values.size} values")
OUT.write_text(json.dumps(out, indent=1) + "\n")
print(f"wrote {OUT}")
