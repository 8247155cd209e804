"""What the optional semantic feature costs: resident memory, index build time and per-issue
latency, with and without it, measured in one process and printed as ratios to the lexical
matcher.

usage: python -m bench.semantic_cost --clusters CLUSTERS.jsonl --queries ISSUES.jsonl [--repeat 3]

Needs the model package (``make install-semantic``). Times are the best of ``--repeat`` runs, as
wall-clock and as this process's CPU time: on a shared machine the CPU time is the steadier
figure. Memory is read from /proc/self/status (Linux): ``anon`` is private memory, ``file`` the
pages of the memory-mapped weights that were read.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bot.clusters.load import load_clusters
from bot.matching import IssueText, Matcher
from bot.matching.scoring import cluster_semantic_text
from bot.matching.semantic import INSTALL_HINT, load_encoder


def memory() -> dict[str, float]:
    """Resident memory in MiB: total, anonymous, file-backed."""
    out = {"rss": 0.0, "anon": 0.0, "file": 0.0}
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                parts = line.split()
                if parts and parts[0] in keys:
                    out[keys[parts[0]]] = int(parts[1]) / 1024
    except OSError:
        pass
    return out


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """Best wall and CPU seconds over ``repeat`` calls, and the last result."""
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        gc.collect()
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus), result


def per_issue(matcher: Matcher, issues: list[IssueText], repeat: int) -> tuple[float, float, float]:
    """Mean wall ms, mean CPU ms and 95th-percentile wall ms of ``rank`` per issue (best pass)."""
    best: tuple[float, float, float] | None = None
    for _ in range(repeat):
        walls, cpus = [], []
        for issue in issues:
            w, c = time.perf_counter(), time.process_time()
            matcher.rank(issue, limit=5)
            walls.append((time.perf_counter() - w) * 1000)
            cpus.append((time.process_time() - c) * 1000)
        p95 = sorted(walls)[max(0, int(len(walls) * 0.95) - 1)]
        run = (statistics.fmean(walls), statistics.fmean(cpus), p95)
        if best is None or run[0] < best[0]:
            best = run
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.semantic_cost")
    parser.add_argument("--clusters", action="append", required=True)
    parser.add_argument("--queries", required=True, help="Issues, JSON Lines (labels ignored).")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    clusters = load_clusters(args.clusters).clusters
    with open(args.queries, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    issues = [
        IssueText(number=r.get("number"), title=str(r.get("title") or ""),
                  body=str(r.get("body") or ""))
        for r in records
    ]
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "-"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{len(clusters)} clusters, {len(issues)} issues, {os.cpu_count()} CPUs,"
          f" BLAS threads {threads}, load average {load:.1f} at start")

    gc.collect()
    mem0 = memory()
    build_w, build_c, lexical = timed(lambda: Matcher(clusters), args.repeat)
    issue_w, issue_c, issue_p95 = per_issue(lexical, issues, args.repeat)
    gc.collect()
    mem1 = memory()

    w = time.perf_counter()
    encoder = load_encoder()
    load_w = time.perf_counter() - w
    if encoder is None:
        print(f"the model package is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    mem2 = memory()
    tokens = sum(len(encoder.tokenizer.encode(cluster_semantic_text(c))) for c in clusters)

    def build_cold() -> Matcher:
        encoder.clear_memo()
        return Matcher(clusters, semantic=encoder)

    sbuild_w, sbuild_c, semantic = timed(build_cold, args.repeat)
    # A rebuild after the cluster files change: unchanged clusters' vectors are remembered.
    warm_w, _, _ = timed(lambda: Matcher(clusters, semantic=encoder), args.repeat)
    sissue_w, sissue_c, sissue_p95 = per_issue(semantic, issues, args.repeat)
    gc.collect()
    mem3 = memory()

    def ratio(a: float, b: float) -> str:
        return f"x{a / b:.1f}" if b > 0 else "-"

    print()
    print("                         lexical       + semantic      ratio")
    print(f"index build, wall      {build_w * 1000:8.0f} ms   {sbuild_w * 1000:9.0f} ms"
          f"   {ratio(sbuild_w, build_w)}")
    print(f"index build, CPU       {build_c * 1000:8.0f} ms   {sbuild_c * 1000:9.0f} ms"
          f"   {ratio(sbuild_c, build_c)}")
    print(f"  rebuild, vectors remembered  {warm_w * 1000:6.0f} ms wall"
          f"   ({ratio(warm_w, build_w)}); {tokens} word pieces in the cluster texts")
    print(f"per issue, wall mean   {issue_w:8.1f} ms   {sissue_w:9.1f} ms"
          f"   {ratio(sissue_w, issue_w)}")
    print(f"per issue, CPU mean    {issue_c:8.1f} ms   {sissue_c:9.1f} ms"
          f"   {ratio(sissue_c, issue_c)}")
    print(f"per issue, wall p95    {issue_p95:8.1f} ms   {sissue_p95:9.1f} ms"
          f"   {ratio(sissue_p95, issue_p95)}")
    lexical_rss = mem1["rss"]
    print(f"resident memory        {lexical_rss:8.0f} MiB  {mem3['rss']:9.0f} MiB"
          f"  {ratio(mem3['rss'], lexical_rss)}  (process total, Python and numpy included)")
    print(f"  the lexical index: +{mem1['rss'] - mem0['rss']:.0f} MiB;"
          f" loading the encoder: +{mem2['rss'] - mem1['rss']:.0f} MiB in {load_w * 1000:.0f} ms;"
          f" after building and ranking with it: +{mem3['rss'] - mem1['rss']:.0f} MiB"
          f" (anon +{mem3['anon'] - mem1['anon']:.0f}, mapped weights +"
          f"{mem3['file'] - mem1['file']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
