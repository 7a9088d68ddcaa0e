"""Runs the grpcurl recipes of docs/operations.md against a running cluster.

Usage: python check.py docs/operations.md --scheduler HOST:PORT --cache HOST:PORT [--grpcurl PATH]

The recipes are the shell block that follows the line
`<!-- grpcurl recipes: checked by clients/grpcurl/check.py -->` in that
file: `# comment` lines, then one command each (`\\` continues a line).
The recipes' addresses 127.0.0.1:50051 (scheduler) and 127.0.0.1:50052
(cache) are replaced by the given ones. Every recipe must exit 0 and print
what its method answers, except one whose comment names INVALID_ARGUMENT,
which must fail with that code. Every user-facing RPC must have a recipe.
"""

import argparse
import json
import re
import shlex
import subprocess
import sys

MARKER = "<!-- grpcurl recipes: checked by clients/grpcurl/check.py -->"
DOC_SCHEDULER = "127.0.0.1:50051"
DOC_CACHE = "127.0.0.1:50052"
REQUIRED = {
    "list",
    "grpc.health.v1.Health/Check",
    "kvlease.v1.Scheduler/Generate",
    "kvlease.v1.Scheduler/GetStatus",
    "kvlease.v1.CacheService/GetStats",
}


def recipes(readme):
    """(comment, argv) for each command of the recipe block."""
    text = open(readme, encoding="utf-8").read()
    at = text.find(MARKER)
    if at < 0:
        sys.exit(f"{readme} has no line {MARKER!r}")
    block = re.search(r"```sh\n(.*?)```", text[at:], re.S)
    if block is None:
        sys.exit(f"no ```sh block after {MARKER!r} in {readme}")
    out, comment, pending = [], "", ""
    for line in block.group(1).splitlines():
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.startswith("#"):
            comment = line
        elif line.strip():
            out.append((comment, shlex.split(line)))
    return out


def messages(stdout):
    """The JSON messages grpcurl printed, one after another."""
    decoder, at, found = json.JSONDecoder(), 0, []
    while True:
        while at < len(stdout) and stdout[at].isspace():
            at += 1
        if at >= len(stdout):
            return found
        value, at = decoder.raw_decode(stdout, at)
        found.append(value)


def method_of(argv):
    """`list`, `describe`, or the full method name the recipe calls."""
    args = argv[1:]  # argv[0] is the grpcurl binary
    for i, a in enumerate(args):
        if a in ("list", "describe"):
            return a
        if "/" in a and not a.startswith("-") and (i == 0 or args[i - 1] != "-d"):
            return a
    return "?"


def expect(method, argv, out):
    """None when `out` is what `method` answers, else what is wrong."""
    if method == "list":
        names = out.split()
        missing = [s for s in ("grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection") if s not in names]
        kvlease = [n for n in names if n.startswith("kvlease.v1.")]
        return f"missing {missing}" if missing or not kvlease else None
    if method == "describe":
        return None if "rpc " in out else "no rpc in the description"
    found = messages(out)
    if not found:
        return "no message printed"
    if method == "grpc.health.v1.Health/Check":
        return None if found[-1].get("status") == "SERVING" else f"not SERVING: {found[-1]}"
    if method == "kvlease.v1.Scheduler/Generate":
        last = found[-1]
        tokens = sum(len(m.get("tokens", [])) for m in found)
        if last.get("finishReason") not in ("LENGTH", "STOP") or tokens == 0:
            return f"no tokens or no finish reason: {found}"
        return None
    if method == "kvlease.v1.Scheduler/GetStatus":
        s = found[0]
        return None if s.get("policy") and s.get("pools") else f"no policy or pools: {s}"
    if method == "kvlease.v1.CacheService/GetStats":
        s = found[0]
        pools = s.get("pools", [])
        return None if pools and all(int(p.get("total", 0)) > 0 for p in pools) else f"no pools: {s}"
    return None


def summary(run):
    """One line of what a recipe printed: its last message, or its error."""
    try:
        found = messages(run.stdout)
    except ValueError:
        found = []
    if found:
        n = f"{len(found)} messages, the last: " if len(found) > 1 else ""
        line = n + json.dumps(found[-1], separators=(",", ":"))
    else:
        line = " ".join((run.stdout.strip() or run.stderr.strip()).split())
    return line if len(line) <= 160 else line[:157] + "..."


def main():
    p = argparse.ArgumentParser()
    p.add_argument("doc")
    p.add_argument("--scheduler", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--grpcurl", default="grpcurl")
    a = p.parse_args()

    seen, failed = set(), 0
    for comment, argv in recipes(a.doc):
        if not argv or argv[0] != "grpcurl":
            print(f"FAIL: a recipe that is not a grpcurl command: {argv}")
            failed += 1
            continue
        argv = [a.grpcurl] + [x.replace(DOC_SCHEDULER, a.scheduler).replace(DOC_CACHE, a.cache)
                              for x in argv[1:]]
        method = method_of(argv)
        seen.add(method)
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        shown = " ".join(shlex.quote(x) for x in argv[1:])
        if "INVALID_ARGUMENT" in comment:
            ok = run.returncode != 0 and "InvalidArgument" in run.stderr
            why = None if ok else f"expected InvalidArgument, got exit {run.returncode}: {run.stderr.strip()}"
        elif run.returncode != 0:
            why = f"exit {run.returncode}: {run.stderr.strip()}"
        else:
            why = expect(method, argv, run.stdout)
        if why is None:
            print(f"ok: grpcurl {shown}\n    -> {summary(run)}")
        else:
            print(f"FAIL: grpcurl {shown}\n    {why}")
            failed += 1
    missing = sorted(REQUIRED - seen)
    if missing:
        print(f"FAIL: {a.doc} has no recipe for {missing}")
        failed += 1
    if failed:
        sys.exit(1)
    print(f"grpcurl recipes passed ({len(seen)} methods)")


if __name__ == "__main__":
    main()
