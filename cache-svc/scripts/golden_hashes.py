#!/usr/bin/env python3
"""The golden values of `cache-svc/src/prefix.rs` (test `golden_values`),
recomputed without the Rust code: SipHash-1-3 written out from the paper
(Aumasson and Bernstein, "SipHash: a fast short-input PRF", 2012) over the
byte encoding that `prefix.rs` and `proto/kvlease/v1/cache.proto` document:

- salt hash = 0 for the empty salt, else SipHash-1-3, keys (0, 0), over
  `byte length (u64 LE) | UTF-8 bytes`;
- block hash = SipHash-1-3, keys (0, 0), over
  `parent (u64 LE) | salt hash (u64 LE) | token (u32 LE) ...`, 0 mapped to 1.

Run: `python3 cache-svc/scripts/golden_hashes.py` prints each value as the
test writes it. `--check` also compares them with the constants in the test
and exits 1 on any difference. The script first checks its SipHash against
the paper's own test vector (SipHash-2-4, key 00..0f, message 00..0e).
"""

import re
import struct
import sys
from pathlib import Path

MASK = (1 << 64) - 1


def rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & MASK


def sipround(v0, v1, v2, v3):
    v0 = (v0 + v1) & MASK
    v1 = rotl(v1, 13) ^ v0
    v0 = rotl(v0, 32)
    v2 = (v2 + v3) & MASK
    v3 = rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & MASK
    v3 = rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & MASK
    v1 = rotl(v1, 17) ^ v2
    v2 = rotl(v2, 32)
    return v0, v1, v2, v3


def siphash(data, k0=0, k1=0, c=1, d=3):
    """SipHash-c-d of `data` (bytes) under the key (k0, k1); 64-bit output."""
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    tail = len(data) % 8
    for i in range(0, len(data) - tail, 8):
        (m,) = struct.unpack("<Q", data[i : i + 8])
        v3 ^= m
        for _ in range(c):
            v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
        v0 ^= m
    # last block: the remaining bytes, then the length's low byte on top
    b = (len(data) & 0xFF) << 56
    for j, byte in enumerate(data[len(data) - tail :]):
        b |= byte << (8 * j)
    v3 ^= b
    for _ in range(c):
        v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    v0 ^= b
    v2 ^= 0xFF
    for _ in range(d):
        v0, v1, v2, v3 = sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def salt_hash(salt):
    if not salt:
        return 0
    raw = salt.encode("utf-8")
    return siphash(struct.pack("<Q", len(raw)) + raw)


def block_hash(parent, salt, tokens):
    data = struct.pack("<QQ", parent, salt) + b"".join(struct.pack("<I", t) for t in tokens)
    return max(siphash(data), 1)


def chain(salt, tokens, per_block):
    parent, out = 0, []
    for i in range(0, len(tokens) - len(tokens) % per_block, per_block):
        parent = block_hash(parent, salt, tokens[i : i + per_block])
        out.append(parent)
    return out


def rust_hex(v):
    """0x1234_5678_9abc_def0, as rustfmt leaves the test's literals."""
    h = f"{v:016x}"
    return "0x" + "_".join(h[i : i + 4] for i in range(0, 16, 4))


def main():
    # The paper's appendix A: SipHash-2-4, k = 00 01 .. 0f, m = 00 01 .. 0e.
    k0, k1 = struct.unpack("<QQ", bytes(range(16)))
    paper = siphash(bytes(range(15)), k0, k1, c=2, d=4)
    if paper != 0xA129CA6149BE45E5:
        sys.exit(f"SipHash is wrong: the paper's vector gives {paper:#x}")

    salt = salt_hash("tenant-a")
    b1 = block_hash(0, 0, [1, 2, 3, 4])
    values = [
        ('salt_hash("tenant-a")', salt),
        ("block_hash(ROOT_PARENT, 0, &[1, 2, 3, 4])", b1),
        ("block_hash(b1, 0, &[5, 6, 7, 8])", block_hash(b1, 0, [5, 6, 7, 8])),
        ("block_hash(ROOT_PARENT, salt, &[1, 2, 3, 4])", block_hash(0, salt, [1, 2, 3, 4])),
        ("block_hash(ROOT_PARENT, 0, &(100..116))", block_hash(0, 0, list(range(100, 116)))),
    ]
    assert salt_hash("") == 0
    assert chain(0, [1, 2, 3, 4, 5, 6, 7, 8], 4) == [values[1][1], values[2][1]]
    for name, v in values:
        print(f"{name} = {rust_hex(v)}")

    if "--check" in sys.argv[1:]:
        source = Path(__file__).resolve().parent.parent / "src" / "prefix.rs"
        test = source.read_text().split("fn golden_values()", 1)[1]
        written = [int(h.replace("_", ""), 16) for h in re.findall(r"0x[0-9a-f_]{19}", test)]
        # the test writes the five values, then the chain's two again
        expected = [v for _, v in values] + [values[1][1], values[2][1]]
        if written != expected:
            sys.exit(
                "prefix.rs golden_values differs from this script:\n"
                f"  test:   {[rust_hex(v) for v in written]}\n"
                f"  script: {[rust_hex(v) for v in expected]}"
            )
        print(f"{source}: golden_values matches ({len(written)} constants)")


if __name__ == "__main__":
    main()
