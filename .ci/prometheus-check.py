#!/usr/bin/env python3
"""Checks what Prometheus answers about a kvlease cluster against the
cluster's own GetStatus (`kvlease status`; its pools are the cache's
GetStats). Usage: prometheus-check.py PROMETHEUS_URL KVLEASE_BINARY SCHEDULER
DASHBOARD_JSON STARTED (the cluster's start, Unix seconds).

The dashboard's "Reject ratio" panel is evaluated too, its expression as the
dashboard has it with `$__rate_interval` set to a window that covers the whole
run, and must be within 1% of rejected / finished requests from GetStatus.

Waits for the cluster to be idle and its status to hold still, then for a
scrape of every target after that moment, then compares. Exits 1 and says
which figure disagreed when any does."""

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request

PROM, KV, SCHED, DASHBOARD = sys.argv[1:5]
STARTED = int(sys.argv[5])
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print(f"  MISMATCH {msg}")


def query(expr):
    """The vector Prometheus answers for `expr` now: [(labels, value)]."""
    url = f"{PROM}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise SystemExit(f"prometheus refused {expr!r}: {body}")
    return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]


def scalar(expr):
    result = query(expr)
    if len(result) != 1:
        raise SystemExit(f"{expr!r}: expected one sample, got {result}")
    return result[0][1]


def status():
    """`kvlease status` parsed: counters and one dict per pool."""
    text = subprocess.run([KV, "status", "--scheduler", SCHED], check=True,
                          capture_output=True, text=True).stdout
    s = {"text": text}
    m = re.search(r"queued (\d+), running (\d+)", text)
    s["queued"], s["running"] = int(m[1]), int(m[2])
    m = re.search(r"finished\s+length (\d+), stop (\d+), rejected (\d+), cancelled (\d+), "
                  r"errors (\d+); preemptions (\d+)", text)
    keys = ["length", "stop", "rejected", "cancelled", "error", "preemptions"]
    s.update({k: int(v) for k, v in zip(keys, m.groups())})
    cols = ["pool_group", "pool_id", "window", "total", "free", "cached", "in_use", "fenced",
            "grants", "rejects", "evictions"]
    s["pools"] = []
    for line in text.splitlines():
        f = line.split()
        if len(f) == 12 and f[1].isdigit() and f[0] != "pool":
            pool = dict(zip(cols, f))
            for k in cols[2:]:
                pool[k] = int(pool[k])
            s["pools"].append(pool)
    return s


def without_text(s):
    return {k: v for k, v in s.items() if k != "text"}


# 1. the cluster is idle and holds still
deadline = time.time() + 120
before = None
while True:
    s = status()
    if s["queued"] == 0 and s["running"] == 0 and before is not None \
            and without_text(before) == without_text(s):
        break
    if time.time() > deadline:
        raise SystemExit("the cluster did not settle:\n" + s["text"])
    before = s
    time.sleep(1)
settled = time.time()
print("cluster settled; kvlease status:")
print("".join("    " + l + "\n" for l in s["text"].splitlines()))

# 2. every target scraped after that, and up
deadline = time.time() + 60
while True:
    ups = query('up{job=~"kvlease-.*"}')
    stamps = query('timestamp(up{job=~"kvlease-.*"})')
    if len(ups) == 4 and all(v == 1 for _, v in ups) and len(stamps) == 4 \
            and min(v for _, v in stamps) > settled + 0.5:
        break
    if time.time() > deadline:
        raise SystemExit(f"targets not all scraped after the cluster settled: up={ups}")
    time.sleep(0.5)

# 3. compare
checks = 0


def same(what, prom_value, status_value):
    global checks
    checks += 1
    if abs(prom_value - status_value) > 1e-9:
        fail(f"{what}: prometheus {prom_value} vs status {status_value}")


def per_pool(expr):
    return {(m["pool_group"], m["pool_id"]): v for m, v in query(expr)}


pools = s["pools"]
if not pools:
    raise SystemExit("status lists no pool")
states = {}
for m, v in query('kvlease_pool_blocks{job="kvlease-cache"}'):
    states[(m["pool_group"], m["pool_id"], m["state"])] = v
capacity = per_pool('kvlease_pool_capacity_blocks{job="kvlease-cache"}')
grants = per_pool('kvlease_pool_grants_total{job="kvlease-cache"}')
rejects = per_pool('kvlease_pool_rejects_total{job="kvlease-cache"}')
evictions = per_pool('kvlease_evictions_total{job="kvlease-cache"}')
for p in pools:
    key = (p["pool_group"], str(p["pool_id"]))
    name = f"{key[0]} pool {key[1]}"
    for state in ["free", "cached", "in_use", "fenced"]:
        same(f"{name} {state} blocks", states.get(key + (state,), float("nan")), p[state])
    same(f"{name} capacity", capacity.get(key, float("nan")), p["total"])
    same(f"{name} grants", grants.get(key, 0.0), p["grants"])
    same(f"{name} rejects", rejects.get(key, 0.0), p["rejects"])
    same(f"{name} evictions", evictions.get(key, 0.0), p["evictions"])

total_rejects = sum(p["rejects"] for p in pools)
total_grants = sum(p["grants"] for p in pools)
if total_rejects == 0:
    fail("the bench caused no reject: it did not over-subscribe the pools")
ratio = scalar('sum(kvlease_pool_rejects_total) / (sum(kvlease_pool_grants_total) + '
               'sum(kvlease_pool_rejects_total))')
same("reject rate (rejects / (grants + rejects))", ratio,
     total_rejects / (total_grants + total_rejects))

by_reason = {}
for m, v in query('sum by (job, reason) (kvlease_rejects_total)'):
    by_reason.setdefault(m["reason"], {})[m["job"]] = v
for reason, jobs in sorted(by_reason.items()):
    same(f"rejects {reason}: cache counted vs scheduler was refused",
         jobs.get("kvlease-cache", 0.0), jobs.get("kvlease-scheduler", 0.0))

finished = {m["reason"]: v for m, v in query('kvlease_requests_finished_total')}
missing = {"length", "stop", "rejected", "cancelled", "error"} - finished.keys()
if missing:
    fail(f"kvlease_requests_finished_total has no series for {sorted(missing)}: "
         "every reason is exported from the start, at 0")
for reason in ["length", "stop", "rejected", "cancelled", "error"]:
    same(f"requests finished {reason}", finished.get(reason, 0.0), s[reason])
same("preemptions", scalar('sum(kvlease_preemptions_total) or vector(0)'), s["preemptions"])
same("queue depth", scalar('kvlease_queue_depth'), s["queued"])
same("running sequences", scalar('kvlease_running_sequences'), s["running"])
same("requests timed", scalar('sum(kvlease_request_duration_seconds_count)'),
     sum(s[k] for k in ["length", "stop", "rejected", "cancelled", "error"]))

# the dashboard's reject ratio: requests rejected over requests finished
def panel_expr(title):
    with open(DASHBOARD) as f:
        panels = json.load(f)["panels"]
    exprs = [t["expr"] for p in panels if p.get("title") == title for t in p.get("targets", [])]
    if len(exprs) != 1:
        raise SystemExit(f"{DASHBOARD}: expected one query in panel {title!r}, got {exprs}")
    return exprs[0]


expr = panel_expr("Reject ratio")
# a window reaching back past the cluster's start: the ratio of the whole run
run_window = f"{int(time.time()) - STARTED + 60}s"
panel = scalar(expr.replace("$__rate_interval", run_window))
finished_total = sum(s[k] for k in ["length", "stop", "rejected", "cancelled", "error"])
if s["rejected"] == 0:
    fail("the bench rejected no request: the reject ratio is not tested")
truth = s["rejected"] / finished_total
checks += 1
print(f"dashboard reject ratio over [{run_window}]: {panel:.6f}; GetStatus: "
      f"{s['rejected']} rejected of {finished_total} finished = {truth:.6f}")
if abs(panel - truth) > 0.01 * truth:
    fail(f"dashboard reject ratio {panel:.6f} is not within 1% of rejected/finished {truth:.6f} "
         f"(expression {expr})")

# the rest is printed for the record
print("prometheus says:")
for expr in ['sum by (job, op, reason) (kvlease_rejects_total)',
             'sum by (reason) (kvlease_preemptions_total)',
             'sum by (state) (kvlease_pool_blocks)',
             'histogram_quantile(0.5, sum by (le) (kvlease_time_to_first_token_seconds_bucket))',
             'histogram_quantile(0.9, sum by (le) (kvlease_request_duration_seconds_bucket{reason=~"length|stop"}))',
             'sum(kvlease_output_tokens_total)']:
    for m, v in query(expr):
        labels = ",".join(f"{k}={v2}" for k, v2 in sorted(m.items()))
        print(f"    {expr}  {{{labels}}}  {v:g}")

if FAILURES:
    print(f"prometheus-test: FAIL ({len(FAILURES)} of {checks} figures disagree)")
    sys.exit(1)
print(f"prometheus-test: PASS ({checks} figures agree with GetStatus/GetStats; "
      f"{total_rejects} rejects of {total_grants + total_rejects} answers, "
      f"{s['preemptions']} preemptions)")
