#!/usr/bin/env python3
"""Reference encodings of SmolLM2's tokenizer, made by the Python `tokenizers`
package, for `tokenizer/tests/smollm2.rs`.

The tokenizer is built from the GGUF's `tokenizer.ggml.*` metadata by
transformers' own GGUF converter (`convert_gguf_tokenizer`), with one
correction: for the `smollm` pre-tokenizer transformers keeps GPT-2's split,
while llama.cpp (the GGUF's authority, `LLAMA_VOCAB_PRE_TYPE_SMOLLM`: `\\p{N}`
first) and SmolLM2's own tokenizer.json split digits one by one first
(`Digits(individual_digits=True)` before `ByteLevel`). The script says how
many of the strings that correction changes.

Chats are rendered with transformers' chat-template renderer (Jinja2,
trim_blocks/lstrip_blocks, add_generation_prompt=True) and encoded without
adding special tokens, as `apply_chat_template(tokenize=True)` does.

Usage: python3 tokenizer/scripts/smollm2_reference.py GGUF [OUT.json]
Needs: pip install gguf tokenizers transformers (no torch needed).
"""

import hashlib
import json
import random
import sys

import tokenizers
from tokenizers import pre_tokenizers
from gguf import GGUFReader
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    _SPECIAL_TOKENS,
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)
from transformers.utils.chat_template_utils import render_jinja_template

HAND_WRITTEN = [
    # plain English, contractions, case
    "The capital of France is",
    "Hello, world!",
    "hello world",
    "HELLO WORLD",
    "I'm sure you'll see they've done it; we'd know, wouldn't we? It's John's.",
    "DON'T SHOUT, I'LL HEAR YOU",
    "a",
    " ",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    # whitespace runs
    "  two leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\n\nline four",
    "windows\r\nline\r\nendings",
    "\n\n\n",
    "    indented four",
    "mixed \t \n \r\n  whitespace",
    "word      word",
    "\u00a0non-breaking\u00a0space",
    "\u3000ideographic space",
    " leading space",
    "\ttab first",
    # numbers
    "0",
    "1234567890",
    "3.14159265358979",
    "1,000,000 and 1.000.000",
    "-42 +17 1e-10 6.02e23",
    "Call 555-123-4567 or +44 20 7946 0958",
    "2026-12-01T09:40:00Z",
    "0xDEADBEEF 0b1010 0o777",
    "Version 1.2.3-rc.4",
    "99 bottles of beer on the wall, 99 bottles of beer",
    "pi is about 22/7 or 355/113",
    "$1,234.56 and \u20ac99,99 and \u00a5500",
    "100% of 50% is 50%",
    "1st 2nd 3rd 4th 21st",
    # unicode
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade",
    "Stra\u00dfe \u00fcber M\u00fcller",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002",
    "\u4e2d\u6587\u6d4b\u8bd5\uff0c\u4f60\u597d\u4e16\u754c\uff01",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0646\u0635",
    "\u05e2\u05d1\u05e8\u05d9\u05ea",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u092a\u093e\u0920",
    "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
    "e\u0301 combining acute",
    "\u212b angstrom vs \u00c5",
    "\ufb01 ligature",
    "\U0001d54f\U0001d560\U0001d565 math letters",
    "zero\u200bwidth\u200bspace",
    "\u00bfQu\u00e9 tal? \u00a1Muy bien!",
    "\u00ab guillemets \u00bb \u201cquotes\u201d \u2018single\u2019",
    "em\u2014dash en\u2013dash \u2026 ellipsis",
    # emoji
    "\U0001f600",
    "I love \U0001f355 and \U0001f363!",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 family",
    "\U0001f44d\U0001f3fd thumbs",
    "\U0001f1eb\U0001f1f7 \U0001f1ef\U0001f1f5 flags",
    "\u2764\ufe0f heart",
    "\U0001f680\U0001f680\U0001f680",
    "emoji\U0001f600in\U0001f600words",
    # code
    "def f(x):\n    return x * 2\n",
    "fn main() {\n    println!(\"{}\", 1 + 2);\n}",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "<div class=\"x\"><p>Hello</p></div>",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "import numpy as np\nx = np.arange(10).reshape(2, 5)",
    "#include <stdio.h>\nint main(void) { return 0; }",
    "x += 1; y -= 2; z *= 3; w /= 4; a ||= b; c &&= d;",
    "let v: Vec<u32> = (0..10).map(|i| i * i).collect();",
    "if a != b && c >= d || e <= f { /* comment */ }",
    "// a comment\n/* block\n comment */",
    "    if x:\n        pass\n    else:\n        raise ValueError('bad')",
    "git commit -m \"fix: off-by-one in tokenizer\"",
    "https://example.com/path?query=1&other=two#frag",
    "user@example.com",
    "C:\\Users\\name\\file.txt",
    "$ cargo test -p kvlease-tokenizer -- --nocapture",
    # punctuation runs
    "!!!???...",
    "----====____",
    "((()))[[[]]]{{{}}}",
    "a.b,c;d:e!f?g",
    "''''\"\"\"\"",
    "@#$%^&*~`|\\",
    # special tokens written in the text
    "<|im_start|>user\nHi<|im_end|>",
    "<|endoftext|>",
    "text<|im_end|>more",
    "<|im_start|><|im_start|>",
    "<repo_name>kvlease<file_sep>src/lib.rs",
    "<|im_start",
    "<| im_start |>",
]

FRAGMENTS = [
    "the", " of", " and", "Tokenizer", " 42", "2026", " 3.5", "\u00e9t\u00e9", " \u4e16\u754c",
    "\U0001f600", "  ", "\n", "\t", "\r\n", "()", " {", "}", "=>", "::", " 'quoted'",
    " don't", " \u0928\u092e\u0938\u094d\u0924\u0947", "\u00fc", " 1e9", "0x1F", "<|im_end|>",
    " \u2014", "...", " emoji\U0001f389", "     ", " A", "z", "!", "#", "%", "\u00a0",
]


def strings():
    out = list(HAND_WRITTEN)
    rng = random.Random(20261201)
    while len(out) < 360:
        out.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12))))
    return out


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a haiku about caches."},
        {"role": "assistant", "content": "Blocks leased, then released."},
        {"role": "user", "content": "Another, with an emoji \U0001f600 please."},
    ],
    [{"role": "user", "content": "def f(x):\n    return x\n"}],
]


def read_tokenizer(gguf_path):
    """What transformers' `get_gguf_tokenizer` returns, read with the `gguf`
    package (transformers' own reader imports torch)."""
    reader = GGUFReader(gguf_path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if key.startswith(("tokenizer.", "general.architecture"))}
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return metadata["general.architecture"], tokenizer, tokenizer_config


def main():
    gguf_path = sys.argv[1]
    out_path = sys.argv[2] if len(sys.argv) > 2 else "tokenizer/tests/fixtures/smollm2_encodings.json"
    with open(gguf_path, "rb") as f:
        md5 = hashlib.md5(f.read()).hexdigest()
    architecture, tokenizer_dict, tokenizer_config = read_tokenizer(gguf_path)
    converted, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    plain = tokenizers.Tokenizer.from_str(converted.to_str())
    tok = converted
    if tokenizer_dict.get("pre_tokenizer_type") == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    cases = []
    changed = 0
    for text in strings():
        ids = tok.encode(text, add_special_tokens=False).ids
        changed += ids != plain.encode(text, add_special_tokens=False).ids
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
    template = tokenizer_config["chat_template"]
    chats = []
    for messages in CHATS:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=template,
            add_generation_prompt=True,
            bos_token=tokenizer_config.get("bos_token"),
            eos_token=tokenizer_config.get("eos_token"),
        )
        text = rendered[0]
        chats.append({"messages": messages, "text": text, "ids": tok.encode(text, add_special_tokens=False).ids})
    fixture = {
        "about": "made by tokenizer/scripts/smollm2_reference.py; do not edit",
        "gguf_md5": md5,
        "tokenizers_version": tokenizers.__version__,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "cases": cases,
        "chats": chats,
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(
        f"{len(cases)} strings, {len(chats)} chats -> {out_path}; "
        f"{changed} strings encode differently without llama.cpp's digit split; "
        f"tokenizers {tokenizers.__version__}, gguf md5 {md5}"
    )


if __name__ == "__main__":
    main()
