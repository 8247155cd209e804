"""The web page's backtest: how long a replay takes by the number of clusters, and what it does
to the event loop that also receives webhooks, run in a thread (the GIL is held by the replay)
against a process of its own (what ``bot/web/pages.py`` does).

usage: python bench/page.py [--sizes 50,100,200,400] [--lag-clusters 200]

The clusters are synthetic, made here: each has two issues with opening dates (one before its
fix merged, one after) whose titles draw five words from a small vocabulary, so that clusters
compete for the same words. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bot.clusters.models import Cluster
from bot.web.dashboard import backtest

WORDS = ["alpha", "beta", "gamma", "delta", "queue", "flush", "exporter", "tooltip", "modal",
         "overlay", "render", "crash", "hang", "timeout", "socket", "parser", "config", "loader",
         "cache", "token", "retry", "widget", "panel", "cursor", "scroll"]


def clusters(n: int, seed: int = 0) -> list[Cluster]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        title = " ".join(rng.sample(WORDS, 5))
        month, day = 1 + (i // 27) % 12, 1 + i % 27
        merged = f"2025-{month:02d}-{day:02d}T12:00:00+00:00"
        pr = 20000 + i
        out.append(Cluster.model_validate({
            "repo": "bench/page", "public_id": str(5000 + i), "display_label": title,
            "summary": title,
            "landed_fix": {"status": "merged_to_main", "basis": "structural", "pr": pr,
                           "merged_at": merged},
            "resolution": {"state": "resolved", "by": f"pr-{pr}"},
            "members": [
                {"kind": "issue", "number": 10000 + 3 * i, "title": title, "state": "closed",
                 "created_at": f"2025-{month:02d}-{day:02d}T00:00:00+00:00"},
                {"kind": "issue", "number": 10001 + 3 * i, "title": title + " again",
                 "state": "closed", "created_at": f"2026-{month:02d}-{day:02d}T00:00:00+00:00"},
                {"kind": "pr", "number": pr, "title": f"fix: {title}", "state": "merged",
                 "merged": True, "is_fix_pr": True, "fix_tier": "verified",
                 "files_changed": [f"src/{rng.choice(WORDS)}.py"]},
            ],
        }))
    return out


async def worst_lag(work: Any) -> tuple[float, float]:
    """(seconds the work took, the loop's worst lag meanwhile, in ms) with a 10 ms ticker."""
    loop = asyncio.get_running_loop()
    lag = 0.0
    done = False

    async def tick() -> None:
        nonlocal lag
        while not done:
            t = loop.time()
            await asyncio.sleep(0.01)
            lag = max(lag, (loop.time() - t - 0.01) * 1000)

    ticker = asyncio.create_task(tick())
    start = time.perf_counter()
    await work()
    took = time.perf_counter() - start
    done = True
    await ticker
    return took, lag


async def lag_phase(n: int) -> dict[str, float]:
    cs = clusters(n)
    thread_s, thread_lag = await worst_lag(lambda: asyncio.to_thread(backtest, cs, 0.7, 0.05))
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    try:
        # The first call starts the process (imports); the page pays it once.
        await loop.run_in_executor(pool, backtest, clusters(5), 0.7, 0.05)
        proc_s, proc_lag = await worst_lag(
            lambda: loop.run_in_executor(pool, backtest, cs, 0.7, 0.05))
    finally:
        pool.shutdown()
    return {"thread_s": thread_s, "thread_lag_ms": thread_lag, "process_s": proc_s,
            "process_lag_ms": proc_lag}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50,100,200,400")
    parser.add_argument("--lag-clusters", type=int, default=200)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'clusters':>8} {'issues':>6} {'replay s':>9}")
    times = {}
    for n in sizes:
        cs = clusters(n)
        start = time.perf_counter()
        view = backtest(cs, 0.7, 0.05)
        times[n] = time.perf_counter() - start
        assert view is not None
        print(f"{n:>8} {view.queries:>6} {times[n]:>9.2f}")
    lag = asyncio.run(lag_phase(args.lag_clusters))
    print(f"\nloop lag during a {args.lag_clusters}-cluster replay: in a thread "
          f"{lag['thread_lag_ms']:.0f} ms ({lag['thread_s']:.2f} s), in a process "
          f"{lag['process_lag_ms']:.0f} ms ({lag['process_s']:.2f} s)")
    print(json.dumps({"replay_s": {str(k): round(v, 3) for k, v in times.items()},
                      "lag_clusters": args.lag_clusters,
                      **{k: round(v, 3) for k, v in lag.items()},
                      "lag_ratio_thread_vs_process": round(
                          lag["thread_lag_ms"] / max(lag["process_lag_ms"], 0.1), 1)}))


if __name__ == "__main__":
    main()
