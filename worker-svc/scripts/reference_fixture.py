#!/usr/bin/env python3
"""Reference outputs of SmolLM2-135M-Instruct (Q4_1 GGUF) from transformers.

Loads the GGUF with transformers in float32 (the weights dequantized by the
`gguf` package, the Q/K rows un-permuted by transformers), and for each
prompt below writes:

- `ids`: the prompt's token ids (chat prompts rendered with the model's own
  chat template, generation prompt added);
- `greedy`: the 32-token greedy continuation (argmax of a full forward over
  the prefix at every step, no KV cache, no stop on end-of-sequence);
- `top_ids` / `top_logits`: the top-5 logits at every position of one
  teacher-forced forward over `ids + greedy` (row i: the logits after token i).

worker-svc's `tests/smollm2.rs` (CPU) and `tests/cuda.rs` (GPU) hold our
backends to this file.

    python3 worker-svc/scripts/reference_fixture.py MODEL.gguf OUT.json [--device cpu|cuda]

Needs torch, transformers (>= 5) and gguf. Runs in float32 with TF32 off.
"""

import argparse
import hashlib
import json
import pathlib
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 32
TOP_K = 5

PROMPTS = [
    {"name": "capital", "text": "The capital of France is"},
    {
        "name": "chat",
        "messages": [
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],
    },
    {
        "name": "non_ascii",
        "text": "Voilà une phrase en français: l'été, le garçon naïf et le café. 日本語: 東京は",
    },
    {
        "name": "code",
        "text": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    },
    {"name": "story", "text": "Once upon a time, in a small village by the sea,"},
    {"name": "numbers", "text": "1, 1, 2, 3, 5, 8, 13, 21,"},
]


def md5(path):
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_chat_template(path):
    """The file's own `tokenizer.chat_template`, read with the gguf package."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=pathlib.Path)
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    started = time.time()
    directory, name = str(args.gguf.parent), args.gguf.name
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if not tok.chat_template:
        tok.chat_template = gguf_chat_template(args.gguf)
        print("chat template: read from the GGUF metadata (the tokenizer had none)")
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model = model.to(args.device).eval()
    print(f"loaded in {time.time() - started:.1f} s: {type(model).__name__}, {type(tok).__name__}")

    def logits_of(ids):
        x = torch.tensor([ids], device=args.device)
        return model(input_ids=x, use_cache=False).logits[0].float().cpu()

    out = []
    for p in PROMPTS:
        if "messages" in p:
            text = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            text = p["text"]
            ids = tok(text)["input_ids"]
        greedy = []
        for _ in range(NEW_TOKENS):
            greedy.append(int(logits_of(ids + greedy)[-1].argmax()))
        logits = logits_of(ids + greedy)
        top = logits.topk(TOP_K, dim=-1)
        # Margin between the top two logits where the greedy token was picked.
        margins = (top.values[:, 0] - top.values[:, 1])[len(ids) - 1 : len(ids) - 1 + NEW_TOKENS]
        entry = {
            "name": p["name"],
            "text": text,
            "ids": ids,
            "greedy": greedy,
            "top_ids": top.indices.tolist(),
            "top_logits": [[round(v, 5) for v in row] for row in top.values.tolist()],
        }
        if "messages" in p:
            entry["messages"] = p["messages"]
        out.append(entry)
        print(
            f"{p['name']}: {len(ids)} prompt ids, {len(entry['top_ids'])} teacher-forced rows, "
            f"smallest greedy top-2 margin {float(margins.min()):.4f}\n"
            f"  prompt: {text!r}\n  greedy: {tok.decode(greedy)!r}"
        )

    fixture = {
        "model": name,
        "md5": md5(args.gguf),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": args.device,
        "dtype": "float32",
        "new_tokens": NEW_TOKENS,
        "top_k": TOP_K,
        "prompts": out,
    }
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes) in {time.time() - started:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
