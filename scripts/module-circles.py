"""Import circles between the top-level modules of each crate of the workspace.

An edge A -> B: a non-test, non-comment line of a file of module A names
`crate::B` (or `super::B` from A's top-level file). Prints every circle
(strongly connected component of more than one module) and exits 1 if there
is one. Run from anywhere: `python3 scripts/module-circles.py [ROOT]`."""
import os, re, sys, subprocess, json
root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
meta = json.loads(subprocess.check_output(["cargo", "metadata", "--no-deps", "--format-version", "1"], cwd=root))
def strip_tests(text):
    i = text.find("#[cfg(test)]")
    text = text if i < 0 else text[:i]
    # comments (doc links) are not imports
    return "\n".join(l.split("//")[0] for l in text.splitlines())
bad = 0
for pkg in meta["packages"]:
    for t in pkg["targets"]:
        if not set(t["kind"]) & {"lib", "bin"}: continue
        src = os.path.dirname(t["src_path"])
        if "lib" not in t["kind"] and os.path.basename(t["src_path"]) != "main.rs": continue
        mods = {}
        for dp, dn, fn in os.walk(src):
            if "/tests" in dp[len(src):] or dp[len(src):].startswith("/bin"): continue
            for f in fn:
                if not f.endswith(".rs"): continue
                p = os.path.join(dp, f)
                rel = os.path.relpath(p, src)
                parts = rel[:-3].split(os.sep)
                if parts[-1] in ("lib", "main") and len(parts) == 1: top = None
                else: top = parts[0]
                if parts[-1] in ("tests",) or "tests" in parts: continue
                mods.setdefault(top, []).append(p)
        tops = {m for m in mods if m}
        edges = {m: set() for m in tops}
        for m, files in mods.items():
            if m is None: continue
            for p in files:
                text = strip_tests(open(p).read())
                for b in re.findall(r"crate::(\w+)", text):
                    if b in tops and b != m: edges[m].add(b)
                # super:: from a top-level file (parts length 1 or mod.rs) goes to the crate root
                rel = os.path.relpath(p, src)[:-3].split(os.sep)
                if len(rel) == 1 or (len(rel) == 2 and rel[1] == "mod"):
                    for b in re.findall(r"super::(\w+)", text):
                        if b in tops and b != m: edges[m].add(b)
                # use crate::{a, b::c}
                for grp in re.findall(r"crate::\{([^}]*)\}", text):
                    for b in re.findall(r"(?:^|[,\s{])(\w+)", grp):
                        if b in tops and b != m: edges[m].add(b)
        # Tarjan
        idx = {}; low = {}; st = []; on = set(); comps = []; c = [0]
        def sc(v):
            idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
            for w in edges[v]:
                if w not in idx: sc(w); low[v] = min(low[v], low[w])
                elif w in on: low[v] = min(low[v], idx[w])
            if low[v] == idx[v]:
                comp = []
                while True:
                    w = st.pop(); on.discard(w); comp.append(w)
                    if w == v: break
                comps.append(comp)
        sys.setrecursionlimit(10000)
        for v in sorted(edges):
            if v not in idx: sc(v)
        for comp in comps:
            if len(comp) > 1:
                bad += 1
                cs = set(comp)
                detail = "; ".join(f"{a} -> {', '.join(sorted(edges[a] & cs))}" for a in sorted(comp))
                print(f"{pkg['name']} ({t['name']}): circle {sorted(comp)}: {detail}")
print(f"{bad} circle(s)")
sys.exit(1 if bad else 0)
