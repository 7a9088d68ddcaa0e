#!/usr/bin/env python3
"""Tiny random-weight checkpoints of every architecture kvlease serves, and
what transformers computes with them: `worker-svc/tests/data/arch/<name>/`.

Each directory is a Hugging Face checkpoint (config.json, bf16 safetensors,
tokenizer.json, tokenizer_config.json) plus `reference.json`: for four
prompts, the token ids, 32 greedy tokens, the full logits row after the
prompt, and the top-8 logits at every position of prompt + greedy tokens
(teacher-forced), all computed by transformers in float32 on the CPU from
the same bf16-rounded weights (so the reference and kvlease start from
identical numbers).

The tokenizer is Qwen2's (the `ggml-vocab-qwen2.gguf` vocabulary file that
llama.cpp ships, found in the `llama-cpp-python` source distribution on
PyPI), truncated to its first 1021 tokens (the 256 byte tokens and the first
765 merges, in rank order, so every merge's result is kept) plus
<|endoftext|>, <|im_start|> and <|im_end|>: a real byte-level BPE with its
real pre-tokenizer and chat template, whose 1024-row embedding keeps each
checkpoint near 300 KB (the full vocabulary would make each one 150k x
hidden).

The Qwen2 and Qwen3 checkpoints are also converted to GGUF (bf16, as
`gguf/<name>-bf16.gguf`) with llama.cpp's own `convert_hf_to_gguf.py` from
the same source distribution; its check of the tokenizer's hash does not
know the cut vocabulary, so the pre-tokenizer is named for it: "qwen2", the
one this tokenizer uses.

Top-1 margins. Random weights make flat logits: the top two of a row are
often within 1e-2 of its scale, about what the CUDA backend's bf16 rounding
moves a logit, so a GPU pass may pick the other one where transformers' f32
pass did not (a rounding, not a wrong pass). The script therefore measures,
for every fixture, the smallest top-1 margin over all teacher-forced
positions (top-1 minus top-2 logit, relative to the row's largest |logit|)
and the bf16 error: the largest relative change of any logit when the same
model runs with the GPU's roundings (every matrix product's input, and
Q/K/V in attention, rounded to bf16; f32 elsewhere). A top-1 can only flip
where its margin is under twice the error (two logits moving apart);
`MARGIN_FACTOR` doubles that for what the emulation leaves out (summation
order, bf16 attention probabilities). Both figures go in reference.json.

The fixtures listed in `DIRECT` must clear that bound at every position:
their weights are drawn like a trained model's, whose direct path
(embedding to output head) carries most of the next-token prediction: the
embedding is scaled up so it dominates the residual stream, and the output
head's row for token pi(t) leans on t's embedding (pi a random permutation),
so each token strongly predicts its successor under pi while the layers
still add a context-dependent part of every logit and decide the top-1
where it outweighs the direct path. Seeds are drawn again until the bound
is cleared (and every greedy step is decisive), not positions picked.

Usage (torch, transformers, safetensors, gguf, sentencepiece from PyPI):
    pip download llama-cpp-python --no-deps --no-binary :all:   # unpack it
    python3 worker-svc/scripts/make_arch_fixtures.py \
        --vocab-gguf .../vendor/llama.cpp/models/ggml-vocab-qwen2.gguf \
        --llama-cpp .../vendor/llama.cpp
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import gguf
import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "arch")

REGULAR = 1021
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = REGULAR + len(SPECIALS)
EOS = REGULAR + 2
PAD = REGULAR
NEW_TOKENS = 32
# Converted to GGUF too: the GGUF architectures kvlease reads besides llama.
GGUF_ARCHS = ["qwen2", "qwen3"]
CONVERT = """
import os, runpy, sys
llama_cpp = sys.argv[1]
sys.path[:0] = [llama_cpp, os.path.join(llama_cpp, "gguf-py")]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(os.path.join(llama_cpp, "convert_hf_to_gguf.py"), run_name="__main__")
"""
TOP_K = 8
# The minimum teacher-forced top-1 margin a DIRECT fixture needs, in units
# of its bf16 error: 2 (two logits moving apart) times 2 (what the emulation
# leaves out).
MARGIN_FACTOR = 4.0
# Fixtures with a direct path (see the docstring): (embedding scale, weight
# of the permuted embedding in the output head against its random part).
# Qwen3's GPU pass flipped 3 near-tied top-1s of 220 on the plain weights.
DIRECT = {"qwen3": (2.0, 2.0)}

PROMPTS = [
    ("capital", "The capital of France is"),
    ("code", "def fibonacci(n):\n    return"),
    ("story", "Once upon a time, in a land far away, there lived"),
    ("chat", None),  # the chat template over CHAT
]
CHAT = [{"role": "user", "content": "What is the tallest mountain in the world?"}]

# Qwen2's tokenizer.json, less its vocabulary.
PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {
            "type": "Split",
            "pattern": {
                "Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
                " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
            },
            "behavior": "Isolated",
            "invert": False,
        },
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ],
}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def write_tokenizer(vocab_gguf, out_dir):
    reader = gguf.GGUFReader(vocab_gguf)
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data]
    field = reader.fields["tokenizer.ggml.merges"]
    merges = [bytes(field.parts[i]).decode() for i in field.data]
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    kept = tokens[:REGULAR]
    index = {t: i for i, t in enumerate(kept)}
    # Token 256 + i is the result of merge i: the first REGULAR - 256 merges
    # are exactly those whose results are kept.
    kept_merges = []
    for i, m in enumerate(merges[: REGULAR - 256]):
        a, b = m.split(" ")
        assert index[a + b] == 256 + i, (m, i)
        kept_merges.append([a, b])
    vocab = dict(index)
    added = []
    for i, s in enumerate(SPECIALS):
        vocab[s] = REGULAR + i
        added.append({"id": REGULAR + i, "content": s, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": PRE_TOKENIZER,
        "post_processor": BYTE_LEVEL,
        "decoder": BYTE_LEVEL,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": kept_merges},
    }
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False, separators=(",", ":"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 512,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)


COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=PAD,
    eos_token_id=EOS,
    pad_token_id=PAD,
)

LONGROPE_SHORT = [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.6, 3.1]
LONGROPE_LONG = [1.0, 1.2, 1.6, 2.4, 3.5, 5.0, 7.5, 10.0]

ARCHS = {
    # Llama 3.1 RoPE scaling; saved in shards.
    "llama3": ("LlamaConfig", dict(
        head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # Q/K/V biases, tied embeddings (as Qwen2.5-0.5B).
    "qwen2": ("Qwen2Config", dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Per-head Q/K norms, head_dim 32 decoupled from hidden / heads (16).
    "qwen3": ("Qwen3Config", dict(
        head_dim=32, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Sliding window on every layer, narrower than the prompts.
    "mistral": ("MistralConfig", dict(
        head_dim=16, sliding_window=8, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # (1 + w) norms, sandwich norms, GeGLU, embedding scale, soft-caps,
    # query_pre_attn_scalar, alternating windows.
    "gemma2": ("Gemma2Config", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Q/K norms, local layers with their own RoPE base, linear scaling on
    # the global ones.
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        })),
    # Fused qkv_proj and gate_up_proj, LongRoPE (short factors: the prompts
    # stay under original_max_position_embeddings; attention factor from
    # max / original = 4).
    "phi3": ("Phi3Config", dict(
        max_position_embeddings=1024, original_max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": LONGROPE_SHORT, "long_factor": LONGROPE_LONG,
                         "original_max_position_embeddings": 256, "partial_rotary_factor": 1.0})),
}


def randomize(model, gemma, seed, direct=None):
    """Weights that make decisive logits, rounded to bf16; with `direct`
    (embedding scale, head weight: see `DIRECT`), the direct path."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                v = torch.randn(p.shape, generator=g) * 0.3
            elif p.dim() == 1:
                # Norm weights: effective scale near 1 (Gemma stores w of 1 + w).
                v = (torch.rand(p.shape, generator=g) - 0.5) * 0.4 + (0.0 if gemma else 1.0)
            elif "embed_tokens" in name or "lm_head" in name:
                # Gemma multiplies the embedding by sqrt(hidden) = 8: smaller
                # rows, so the layers (not the input token) decide the output.
                v = torch.randn(p.shape, generator=g) * (0.06 if gemma else 0.5)
            else:
                v = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
            p.copy_(v.to(torch.bfloat16).to(torch.float32))
        if direct:
            scale, weight = direct
            embed = model.model.embed_tokens.weight
            head = model.lm_head.weight
            assert embed.data_ptr() != head.data_ptr(), "a direct path needs an untied head"
            perm = torch.randperm(embed.shape[0], generator=g)
            # Row j of the head leans on the embedding of token perm[j]
            # (before scaling), keeping the rows' norm.
            head.copy_(bf16((weight * embed[perm] + head) / (1 + weight**2) ** 0.5))
            embed.copy_(bf16(embed * scale))


def bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


class Bf16Products:
    """Within it, `model` computes with the CUDA backend's roundings: the
    input of every matrix product, and Q, K and V in attention (the arena
    holds 16-bit K/V), rounded to bf16."""

    def __init__(self, model):
        self.model = model
        self.module = sys.modules[type(model.model.layers[0].self_attn).__module__]

    def __enter__(self):
        self.hooks = [m.register_forward_pre_hook(lambda _, args: (bf16(args[0]),) + args[1:])
                      for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        self.eager = eager = self.module.eager_attention_forward

        def attention(module, q, k, v, mask, **kwargs):
            return eager(module, bf16(q), bf16(k), bf16(v), mask, **kwargs)

        self.module.eager_attention_forward = attention

    def __exit__(self, *_):
        self.module.eager_attention_forward = self.eager
        for h in self.hooks:
            h.remove()


def margins(model, seq):
    """For every position of seq (teacher-forced): the top-1 margin and the
    largest bf16 change of a logit, both relative to the row's largest
    |logit|; and the f32 logits."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]
        with Bf16Products(model):
            rounded = model(torch.tensor([seq])).logits[0]
    scale = logits.abs().max(dim=-1).values
    top = torch.topk(logits, 2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]) / scale
    error = (rounded - logits).abs().max(dim=-1).values / scale
    return margin, error, logits


def greedy(model, ids, n):
    """n greedy tokens after ids, each from a full forward pass (no cache),
    and the smallest gap between the top two logits on the way, relative to
    the row's largest |logit|."""
    seq = list(ids)
    margin = float("inf")
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([seq])).logits[0, -1]
        top = torch.topk(row, 2).values
        margin = min(margin, float((top[0] - top[1]) / row.abs().max()))
        seq.append(int(row.argmax()))
    return seq[len(ids):], margin


def fmt(values):
    return [float(f"{v:.7g}") for v in values]


def convert(name, llama_cpp):
    out = os.path.join(OUT, "gguf")
    os.makedirs(out, exist_ok=True)
    target = os.path.join(out, f"{name}-bf16.gguf")
    subprocess.run([sys.executable, "-c", CONVERT, llama_cpp, os.path.join(OUT, name),
                    "--outfile", target, "--outtype", "bf16"], check=True)
    print(f"{name}: {target}, {os.path.getsize(target)} bytes")


def build(name, config_class, extra, vocab_gguf):
    out = os.path.join(OUT, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    write_tokenizer(vocab_gguf, out)
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    kwargs = dict(COMMON)
    kwargs.update(extra)
    config = getattr(transformers, config_class)(**kwargs)
    gemma = name.startswith("gemma")
    direct = DIRECT.get(name)
    for seed in range(200 if direct else 20):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation="eager")
        model.eval()
        randomize(model, gemma, 1000 * seed + len(name), direct)
        prompts = []
        worst = float("inf")
        min_margin, error = float("inf"), 0.0
        for pname, text in PROMPTS:
            messages = None
            if text is None:
                messages = CHAT
                text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            tokens, margin = greedy(model, ids, NEW_TOKENS)
            worst = min(worst, margin)
            margin, err, logits = margins(model, ids + tokens)
            min_margin = min(min_margin, float(margin.min()))
            error = max(error, float(err.max()))
            top = torch.topk(logits, TOP_K, dim=-1)
            entry = {
                "name": pname, "text": text, "ids": ids, "greedy": tokens,
                "last_logits": fmt(logits[len(ids) - 1].tolist()),
                "top_ids": top.indices.tolist(),
                "top_logits": [fmt(r) for r in top.values.tolist()],
            }
            if messages:
                entry["messages"] = messages
            prompts.append(entry)
        # A greedy step decided by less than 1e-3 of the logits' scale could
        # flip under f32 rounding differences: draw other weights.
        bound = MARGIN_FACTOR * error
        if worst >= 1e-3 and (not direct or min_margin >= bound):
            break
        print(f"{name}: seed {seed}: greedy margin {worst:.1e}, top-1 margin {min_margin:.1e}"
              f" (bound {bound:.1e}); drawing again")
    else:
        raise SystemExit(f"{name}: no seed gave decisive greedy tokens")
    if name == "llama3":
        model.to(torch.bfloat16).save_pretrained(out, max_shard_size="200KB")
    else:
        model.to(torch.bfloat16).save_pretrained(out)
    # transformers writes generation_config.json; kvlease reads EOS from it.
    reference = {
        "about": "made by worker-svc/scripts/make_arch_fixtures.py; do not edit",
        "architecture": config.architectures[0] if config.architectures else config_class,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32 (weights bf16-exact)",
        "seed": seed,
        "new_tokens": NEW_TOKENS,
        "min_greedy_margin": worst,
        "min_top1_margin": min_margin,
        "bf16_error": error,
        "margin_bound": bound if direct else None,
        "direct_path": direct,
        "prompts": prompts,
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(reference, f, separators=(",", ":"))
    size = sum(os.path.getsize(os.path.join(out, x)) for x in os.listdir(out))
    print(f"{name}: {config.architectures}, seed {seed}, min greedy margin {worst:.1e}, "
          f"min top-1 margin {min_margin:.1e} (bf16 error {error:.1e}), {size} bytes")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-gguf", required=True, help="llama.cpp's ggml-vocab-qwen2.gguf")
    parser.add_argument("--llama-cpp", help="llama.cpp's source tree, for convert_hf_to_gguf.py")
    parser.add_argument("--only", nargs="*", help="architectures to build (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, (config_class, extra) in ARCHS.items():
        if args.only and name not in args.only:
            continue
        build(name, config_class, extra, args.vocab_gguf)
        if args.llama_cpp and name in GGUF_ARCHS:
            convert(name, args.llama_cpp)


if __name__ == "__main__":
    main()
