"""An independent reference for the logprobs the gateway reports: a Llama
forward pass in numpy over a GGUF file, written from the model's definition
and llama.cpp's conventions, sharing no code with kvlease.

- The weights come from the `gguf` package: `GGUFReader` reads the tensors
  and `gguf.quants.dequantize` turns Q4_1, Q8_0, ... blocks into f32 (the
  f32 values the CPU worker multiplies by: `q * d + m`, each step rounded
  to f32), so the comparison is between two f32 computations of one model.
- GGUF keeps `attn_q` and `attn_k` rows in llama.cpp's order, permuted by
  the converter so that RoPE rotates adjacent pairs (2i, 2i + 1) of each
  head ("normal" RoPE, `LLAMA_ROPE_TYPE_NORM`); the rows are used as they
  are, with that rotation (kvlease un-permutes them and rotates halves, as
  Hugging Face does: the same numbers, another order).
- Shape, RoPE base and RMSNorm epsilon from the `llama.*` metadata; the
  output projection is `output.weight`, or the token embedding when the file
  has none (tied embeddings, as SmolLM2).
- Tokens by their bytes: the GPT-2 byte-level strings of
  `tokenizer.ggml.tokens` mapped back to bytes, so a token's text as the
  OpenAI API shows it (`bytes:\\xNN...` for a piece of a character) names
  its id.

Usage as a module: `Llama(path).logits(ids)` gives `[len(ids), vocab]` f32
logits, row i predicting token i + 1; `log_softmax(row)` in f64.
"""

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def _byte_decoder():
    """GPT-2's byte-level alphabet: the character standing for each byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(text):
    """The bytes a token's text stands for in the OpenAI API's rendering:
    its UTF-8 bytes, or the bytes of a `bytes:\\xNN...` form."""
    if text.startswith("bytes:"):
        hexes = text[len("bytes:"):].split("\\x")[1:]
        return bytes(int(h, 16) for h in hexes)
    return text.encode()


class Llama:
    def __init__(self, path):
        reader = GGUFReader(path)
        meta = {k: f.contents() for k, f in reader.fields.items()
                if not k.startswith("tokenizer.ggml.merges")}
        arch = meta["general.architecture"]
        if arch != "llama":
            raise ValueError(f"general.architecture {arch!r}: this reference is for llama files")
        self.hidden = int(meta["llama.embedding_length"])
        self.layers = int(meta["llama.block_count"])
        self.heads = int(meta["llama.attention.head_count"])
        self.kv_heads = int(meta.get("llama.attention.head_count_kv", self.heads))
        self.head_dim = self.hidden // self.heads
        self.theta = float(meta.get("llama.rope.freq_base", 10000.0))
        self.eps = np.float32(meta["llama.attention.layer_norm_rms_epsilon"])
        for k in ("llama.rope.scaling.type", "llama.expert_count"):
            if meta.get(k) not in (None, "none", 0):
                raise ValueError(f"{k} {meta[k]!r} is not modelled here")
        tensors = {t.name: t for t in reader.tensors}
        if "rope_freqs.weight" in tensors:
            raise ValueError("rope_freqs.weight (llama3 RoPE scaling) is not modelled here")

        def weight(name):
            t = tensors[name]
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            # GGUF dims are innermost first: [cols, rows] is a rows x cols matrix
            return w.reshape([int(d) for d in reversed(t.shape)])

        self.embed = weight("token_embd.weight")
        self.output = weight("output.weight") if "output.weight" in tensors else self.embed
        self.norm = weight("output_norm.weight")
        self.blocks = []
        for i in range(self.layers):
            p = f"blk.{i}."
            self.blocks.append({k: weight(p + k + ".weight") for k in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
        decoder = _byte_decoder()
        self.ids_by_bytes = {}
        for i, s in enumerate(meta["tokenizer.ggml.tokens"]):
            try:
                b = bytes(decoder[c] for c in s)
            except KeyError:
                b = s.encode()  # a special token: its text
            self.ids_by_bytes.setdefault(b, []).append(i)

    def token_id(self, text):
        """The one token whose bytes the OpenAI rendering `text` shows."""
        ids = self.ids_by_bytes.get(token_bytes(text), [])
        if len(ids) != 1:
            raise ValueError(f"token {text!r} names {len(ids)} vocabulary entries: {ids[:5]}")
        return ids[0]

    def _rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, n):
        """llama.cpp's normal RoPE: pairs (2i, 2i + 1) of each head rotated
        by position * theta^(-2i / head_dim). x: [n, heads, head_dim]."""
        d = self.head_dim
        inv = self.theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        angle = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
        cos = np.cos(angle).astype(np.float32)[:, None, :]
        sin = np.sin(angle).astype(np.float32)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def logits(self, ids):
        """f32 logits after every token of `ids` (causal attention over the
        whole sequence from position 0)."""
        n, d = len(ids), self.head_dim
        x = self.embed[np.asarray(ids)]
        causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
        group = self.heads // self.kv_heads
        for b in self.blocks:
            h = self._rms(x, b["attn_norm"])
            q = self._rope((h @ b["attn_q"].T).reshape(n, self.heads, d), n)
            k = self._rope((h @ b["attn_k"].T).reshape(n, self.kv_heads, d), n)
            v = (h @ b["attn_v"].T).reshape(n, self.kv_heads, d)
            k = np.repeat(k, group, axis=1)
            v = np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.float32(np.sqrt(d)) + causal
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", scores, v).reshape(n, self.heads * d)
            x = x + attn @ b["attn_output"].T
            h = self._rms(x, b["ffn_norm"])
            gate = h @ b["ffn_gate"].T
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ b["ffn_up"].T)) @ b["ffn_down"].T
        return self._rms(x, self.norm) @ self.output.T


def log_softmax(row):
    """log_softmax of one logits row, in f64."""
    row = row.astype(np.float64)
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())
