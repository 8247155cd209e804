"""Matching at 1k, 10k and 100k clusters: index build time, peak memory, latency, and two peers.

usage: python bench/match.py [--sizes 1000,10000,100000] [--seed 0] [--profile]

The clusters come from ``bench/gen_clusters.py`` (seeded, recombined from
``../shared/eval/clusters.jsonl``; the real clusters first, so labelled queries keep their
answer), written once as the JSON Lines file the bot loads (the largest size; the smaller ones
are its first lines). The queries come from ``../shared/eval/dev-queries.jsonl`` (title and
body, as the bot gets them). Each size runs in two fresh processes that take turns, never
working at the same time: both load, the peers build, ours builds, then the queries are timed in
``TIME_BLOCKS`` blocks, each block by one and then the other (the order swapped every block), so
that both latencies are taken under the same conditions of the machine (a busy neighbour on a
shared host slows a few seconds, not one side); the peers' brute force runs last:

- *peers*, on the same clusters and queries: bm25s (sparse-matrix BM25 over the label, the
  member titles and the summary, queried with the issue's title and body), and the brute force
  of the potential-duplicates action: Damerau-Levenshtein similarity of the issue title with
  every label and member title (``bot.eval.baselines.TitleEditDistance``, run over chunks of 1,000
  clusters to bound memory; same arithmetic). Its cost is exactly linear in the number of
  titles, a few seconds a query at 10k already, so it is timed on a handful of queries, and
  above ``--brute-clusters`` on a sample of that many clusters, scaled by the ratio of
  titles (the table says so; ``--brute-clusters 0`` times the whole corpus).
- *ours*: what the bot does when its cluster files change, with the bot's own code
  (``IndexHolder.refresh`` with the build always in a separate process): the build process
  loads, validates and indexes the file (with worker processes above 32 MB) and writes the
  arrays; the serving process maps them. ``build_s`` is the wall time from the file to an index
  that answers. Then every dev query is ranked after a warm-up, through ``ClusterIndex.rank``
  as a delivery is. ``peak_rss_mb`` adds up the peaks of every process of the rebuild, as if
  they all peaked at once: the serving process (VmHWM), the build process and each worker.

Last line: one JSON object for the largest size: clusters, build_s, peak_rss_mb, p50_ms,
p99_ms, speedup_vs_bruteforce (brute-force p50 over ours on the same queries), vs_bm25s (our p50
over bm25s's p50; below 1 is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_QUERIES = ROOT.parent / "shared" / "eval" / "dev-queries.jsonl"
DEFAULT_SIZES = (1_000, 10_000, 100_000)
BRUTE_CHUNK = 1_000  # clusters per TitleEditDistance block
# Blocks of queries timed by ours and bm25s in turn (see the docstring).
TIME_BLOCKS = 8

TARGETS = {
    "p99_ms": 5.0,
    "speedup_vs_bruteforce": 500.0,
    "vs_bm25s": 1.5,
    "build_s": 20.0,
    "peak_rss_mb": 1024.0,
}


def _missing(package: str, why: str) -> None:
    print(f"bench/match.py: the Python package {package!r} is not installed ({why}); "
          f"install it with: .venv/bin/pip install {package}", file=sys.stderr)
    sys.exit(2)


def _status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmHWM: peak RSS)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _load_queries(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [{"title": r.get("title") or "", "body": r.get("body") or "",
             "expected": r.get("expected"), "uncertain": bool(r.get("uncertain"))} for r in rows]


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _wait_go() -> None:
    if sys.stdin.readline().strip() != "go":
        sys.exit(0)


def _blocks() -> Iterator[tuple[int, int]]:
    """The query ranges the parent asks a child to time ("time A B"), until "finish"."""
    while True:
        words = sys.stdin.readline().split()
        if not words or words[0] == "finish":
            return
        if words[0] != "time" or len(words) != 3:
            sys.exit(f"bench/match.py child: unexpected command {words!r}")
        yield int(words[1]), int(words[2])


# --- child: our matcher ---------------------------------------------------------------------


def child_ours(args: argparse.Namespace) -> None:
    import asyncio

    from bot.matching import IssueText
    from bot.matching.index import IndexHolder

    queries = _load_queries(args.queries)
    issues = [IssueText(title=q["title"], body=q["body"]) for q in queries]
    with open(args.file, encoding="utf-8") as fh:
        repo = json.loads(fh.readline())["repo"]
    _emit({"phase": "loaded"})
    _wait_go()

    # What the bot does when its cluster files change: load, validate and index them in a
    # build process (the holder's choice for any input this size and up), then map the arrays
    # it wrote. Timed from the files to an index that answers.
    holder = IndexHolder([Path(args.file)], index_dir=Path(args.file).parent / "index",
                         process_above=0)
    t = time.perf_counter()
    asyncio.run(holder.refresh(force=True))
    build = time.perf_counter() - t
    index = holder.current
    assert holder.saved is not None
    rss_built = _status_kb("VmRSS")
    for issue in issues[: args.warmup]:
        index.rank(issue, [repo])
    _emit({"phase": "built"})
    latencies: list[float] = [float("nan")] * len(queries)
    hits = labelled = 0
    for start, end in _blocks():
        # The other process ran meanwhile: the caches are the other's. The query before the
        # block (timed already) warms them again, untimed, as the warm-up did the first time.
        index.rank(issues[start - 1] if start else issues[0], [repo])
        for i in range(start, end):
            q, issue = queries[i], issues[i]
            t = time.perf_counter()
            ranked = index.rank(issue, [repo])
            latencies[i] = (time.perf_counter() - t) * 1000.0
            if q["expected"] and not q["uncertain"]:
                labelled += 1
                hits += bool(ranked and ranked[0].public_id == q["expected"])
        _emit({"phase": "timed"})
    serving_peak = _status_kb("VmHWM") / 1024
    builder_peak = holder.saved.peak_rss_kb / 1024
    worker_peak = holder.saved.worker_peak_rss_kb / 1024
    workers = holder.saved.workers
    result = {
        "phase": "result",
        "clusters": index.size,
        "build_s": build,
        "build_process_s": holder.saved.seconds,
        "rss_built_mb": rss_built / 1024,
        "serving_peak_rss_mb": serving_peak,
        "builder_peak_rss_mb": builder_peak,
        "worker_peak_rss_mb": worker_peak,
        "workers": workers,
        # All of it at once, as if every process peaked together: the memory a rebuild needs.
        "peak_rss_mb": serving_peak + builder_peak + workers * worker_peak,
        "latencies_ms": latencies,
        "p50_ms": _percentile(latencies, 50),
        "p99_ms": _percentile(latencies, 99),
        "max_ms": max(latencies),
        "r_at_1": hits / labelled if labelled else None,
        "labelled": labelled,
    }
    if args.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for issue in issues:
            index.rank(issue, [repo])
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(18)
        stats.sort_stats("cumulative").print_stats(22)
        result["profile"] = out.getvalue()
    _emit(result)


# --- child: the peers -----------------------------------------------------------------------


class _Title:
    __slots__ = ("title",)

    def __init__(self, title: str | None) -> None:
        self.title = title


class _TitlesOnly:
    """What TitleEditDistance reads of a cluster (label, member titles, id), without the cost
    of validating 100k full records it does not look at."""

    __slots__ = ("display_label", "members", "public_id")

    def __init__(self, record: dict[str, Any]) -> None:
        self.public_id = record["public_id"]
        self.display_label = record["display_label"]
        self.members = [_Title(m.get("title")) for m in record.get("members", [])]


def _title_count(clusters: list[_TitlesOnly]) -> int:
    """How many titles TitleEditDistance compares per query (its work is proportional)."""
    total = 0
    for c in clusters:
        total += sum(1 for t in [c.display_label, *(m.title for m in c.members)] if t)
    return total


def child_peers(args: argparse.Namespace) -> None:
    import bm25s

    from bot.eval.baselines import TitleEditDistance

    queries = _load_queries(args.queries)
    texts: list[str] = []
    light: list[_TitlesOnly] = []
    # A record at a time: this process stays up while ours builds, holding only what it needs.
    with open(args.file, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            titles = [m["title"] for m in record.get("members", []) if m.get("title")]
            texts.append(" ".join([record["display_label"], *titles,
                                   record.get("summary") or ""]))
            light.append(_TitlesOnly(record))
    sample = light
    if args.brute_clusters and len(light) > args.brute_clusters:
        sample = random.Random(args.seed).sample(light, args.brute_clusters)
    chunks = [TitleEditDistance(sample[i : i + BRUTE_CHUNK])
              for i in range(0, len(sample), BRUTE_CHUNK)]
    sample_titles = sum(len(c._lengths) for c in chunks)
    all_titles = _title_count(light)
    scale = all_titles / sample_titles if sample_titles else 1.0
    _emit({"phase": "loaded"})
    _wait_go()

    # bm25s: index the cluster text, query with the issue's title and body.
    t = time.perf_counter()
    corpus_tokens = bm25s.tokenize(texts, stopwords="en", show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(corpus_tokens, show_progress=False)
    bm25_build = time.perf_counter() - t
    k = min(5, len(texts))
    del corpus_tokens, texts

    def bm25_query(q: dict[str, Any]) -> None:
        tokens = bm25s.tokenize(q["title"] + "\n" + q["body"], stopwords="en",
                                return_ids=False, show_progress=False)
        retriever.retrieve(tokens, k=k, show_progress=False, n_threads=0)

    for q in queries[: args.warmup]:
        bm25_query(q)
    _emit({"phase": "built"})
    bm25_lat: list[float] = [float("nan")] * len(queries)
    for start, end in _blocks():
        bm25_query(queries[start - 1] if start else queries[0])  # as ours does, untimed
        for i in range(start, end):
            t = time.perf_counter()
            bm25_query(queries[i])
            bm25_lat[i] = (time.perf_counter() - t) * 1000.0
        _emit({"phase": "timed"})

    # Brute force: a handful of queries, spread over the dev set, the same for every size.
    order = list(range(len(queries)))
    random.Random(args.seed).shuffle(order)
    picked = order[: args.brute_queries]
    chunks[0].rank(queries[picked[0]]["title"])  # warm-up on one block
    brute: dict[int, float] = {}
    for qi in picked:
        title = queries[qi]["title"]
        t = time.perf_counter()
        best: list[tuple[str, float]] = []
        for chunk in chunks:
            best.extend(chunk.rank(title, limit=5))
        best.sort(key=lambda kv: -kv[1])
        brute[qi] = (time.perf_counter() - t) * 1000.0 * scale
    _emit({
        "phase": "result",
        "bm25_build_s": bm25_build,
        "bm25_latencies_ms": bm25_lat,
        "bm25_p50_ms": _percentile(bm25_lat, 50),
        "bm25_p99_ms": _percentile(bm25_lat, 99),
        "brute_ms": {str(k): v for k, v in brute.items()},
        "brute_scale": scale,
        "brute_sampled_clusters": len(sample),
        "peers_peak_rss_mb": _status_kb("VmHWM") / 1024,
    })


# --- parent -----------------------------------------------------------------------------------


def _spawn(role: str, size: int, file: Path, args: argparse.Namespace
           ) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", role, "--size", str(size),
           "--file", str(file),
           "--seed", str(args.seed), "--queries", args.queries, "--warmup", str(args.warmup),
           "--brute-queries", str(args.brute_queries),
           "--brute-clusters", str(args.brute_clusters)]
    if args.profile and size == max(args.sizes):
        cmd.append("--profile")
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT))


def _read(proc: subprocess.Popen[str], role: str, phase: str) -> dict[str, Any]:
    """The child's next report, which must be ``phase``: a stray line on its stdout would
    otherwise put the turns out of step."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise SystemExit(f"bench/match.py: the {role} process ended without a result "
                         f"(exit {proc.returncode}); see its error above")
    try:
        report: dict[str, Any] = json.loads(line)
    except ValueError:
        report = {}
    if report.get("phase") != phase:
        raise SystemExit(f"bench/match.py: the {role} process said {line.strip()[:200]!r} "
                         f"where its {phase!r} report was due")
    return report


def _go(proc: subprocess.Popen[str], command: str = "go") -> None:
    assert proc.stdin is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()


def run_size(size: int, file: Path, args: argparse.Namespace) -> dict[str, Any]:
    ours = _spawn("ours", size, file, args)
    peers = _spawn("peers", size, file, args)
    n = len(_load_queries(args.queries))
    edges = [n * b // TIME_BLOCKS for b in range(TIME_BLOCKS + 1)]
    try:
        _read(ours, "ours", "loaded")  # both load at once; neither is timing anything yet
        _read(peers, "peers", "loaded")
        _go(peers)  # each builds while the other waits
        _read(peers, "peers", "built")
        _go(ours)
        _read(ours, "ours", "built")
        for b in range(TIME_BLOCKS):
            turns = [(ours, "ours"), (peers, "peers")]
            for proc, role in turns if b % 2 == 0 else turns[::-1]:
                _go(proc, f"time {edges[b]} {edges[b + 1]}")
                _read(proc, role, "timed")
        _go(peers, "finish")  # the brute force, alone
        p = _read(peers, "peers", "result")
        peers.wait()
        _go(ours, "finish")
        o = _read(ours, "ours", "result")
        ours.wait()
    finally:
        for proc in (ours, peers):
            if proc.poll() is None:
                proc.kill()
    o.update(p)
    brute = {int(k): v for k, v in p["brute_ms"].items()}
    same = [o["latencies_ms"][qi] for qi in brute]
    o["brute_p50_ms"] = _percentile(list(brute.values()), 50)
    o["brute_n"] = len(brute)
    o["ours_p50_on_brute_queries_ms"] = _percentile(same, 50)
    o["speedup_vs_bruteforce"] = o["brute_p50_ms"] / o["ours_p50_on_brute_queries_ms"]
    o["vs_bm25s"] = o["p50_ms"] / o["bm25_p50_ms"]
    return o


def _write_cluster_files(work: Path, sizes: list[int], seed: int) -> dict[int, Path]:
    """The generated clusters as the JSON Lines files the bot loads: the largest set once, the
    smaller ones as its first lines (cluster ``i`` depends only on the seed and ``i``)."""
    from bench.gen_clusters import write_jsonl

    t = time.perf_counter()
    largest = max(sizes)
    (work / f"{largest}").mkdir(parents=True, exist_ok=True)
    files = {largest: write_jsonl(work / f"{largest}" / "clusters.jsonl", largest, seed,
                                  include_real=True)}
    with open(files[largest], "rb") as fh:
        lines = [line for _, line in zip(range(largest), fh, strict=False)]
    for size in sizes:
        if size != largest:
            path = work / f"{size}" / "clusters.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"".join(lines[:size]))
            files[size] = path
    print(f"  generated {largest:,} clusters in {time.perf_counter() - t:.0f}s "
          f"({files[largest].stat().st_size / 1e6:,.0f} MB of JSON Lines)", flush=True)
    return files


def _fmt(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ["clusters", "build s", "in builder s", "serving MB", "builder MB", "workers MB",
            "peak RSS MB", "p50 ms", "p99 ms",
            "max ms", "R@1", "bm25s build s", "bm25s p50 ms", "bm25s p99 ms",
            "brute p50 ms (n)", "speedup vs brute", "ours/bm25s p50"]
    table = [head]
    for r in rows:
        brute = f"{_fmt(r['brute_p50_ms'], 0)} ({r['brute_n']}"
        brute += f", x{r['brute_scale']:.1f} of {r['brute_sampled_clusters']:,})" \
            if r["brute_scale"] > 1.0001 else ")"
        table.append([
            f"{r['clusters']:,}", _fmt(r["build_s"], 2), _fmt(r["build_process_s"], 2),
            _fmt(r["serving_peak_rss_mb"], 0), _fmt(r["builder_peak_rss_mb"], 0),
            f"{r['workers']} x {_fmt(r['worker_peak_rss_mb'], 0)}",
            _fmt(r["peak_rss_mb"], 0), _fmt(r["p50_ms"], 2),
            _fmt(r["p99_ms"], 2), _fmt(r["max_ms"], 2),
            f"{r['r_at_1']:.2f}" if r["r_at_1"] is not None else "-",
            _fmt(r["bm25_build_s"], 2), _fmt(r["bm25_p50_ms"], 2), _fmt(r["bm25_p99_ms"], 2),
            brute, f"{r['speedup_vs_bruteforce']:,.0f}x", f"{r['vs_bm25s']:.2f}",
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for n, row in enumerate(table):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def print_targets(r: dict[str, Any]) -> None:
    checks = [
        ("match p99", r["p99_ms"], "ms", "<=", TARGETS["p99_ms"]),
        ("speedup vs brute force", r["speedup_vs_bruteforce"], "x", ">=",
         TARGETS["speedup_vs_bruteforce"]),
        ("p50 vs bm25s p50", r["vs_bm25s"], "x", "<=", TARGETS["vs_bm25s"]),
        ("index build", r["build_s"], "s", "<=", TARGETS["build_s"]),
        ("peak RSS", r["peak_rss_mb"], "MB", "<=", TARGETS["peak_rss_mb"]),
    ]
    print(f"\ntargets at {r['clusters']:,} clusters:")
    for name, value, unit, op, target in checks:
        met = value <= target if op == "<=" else value >= target
        print(f"  {name:<24} {value:>12,.2f} {unit:<3} target {op} {target:,.1f} {unit:<3}"
              f" {'met' if met else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/match.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="comma-separated cluster counts (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries", default=str(DEFAULT_QUERIES))
    parser.add_argument("--warmup", type=int, default=10, help="untimed queries first")
    parser.add_argument("--brute-queries", type=int, default=3,
                        help="queries timed for the brute force at each size")
    parser.add_argument("--brute-clusters", type=int, default=5_000,
                        help="brute force timed on a sample of at most this many clusters, "
                        "scaled to the corpus (0: the whole corpus)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile our rank() over the dev queries at the largest size")
    parser.add_argument("--child", choices=("ours", "peers"), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]

    if args.child == "ours":
        child_ours(args)
        return 0
    if args.child == "peers":
        child_peers(args)
        return 0

    for package, why in (("bm25s", "the sparse-matrix BM25 peer"), ("numpy", "every matcher")):
        if importlib.util.find_spec(package) is None:
            _missing(package, why)
    import bm25s
    import numpy

    started = time.perf_counter()
    load = os.getloadavg()
    print(f"bench/match.py: {os.cpu_count()} cores, load average {load[0]:.2f} at start; "
          f"Python {platform.python_version()}, numpy {numpy.__version__}, "
          f"bm25s {bm25s.__version__}; {len(_load_queries(args.queries))} dev queries, "
          f"{args.warmup} warm-up; seed {args.seed}", flush=True)
    if load[0] > 0.5:
        print("  note: the machine is busy; latencies are inflated, same-run ratios less so",
              flush=True)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="dejafix-bench-match-"))
    try:
        files = _write_cluster_files(work, args.sizes, args.seed)
        for size in args.sizes:
            t = time.perf_counter()
            rows.append(run_size(size, files[size], args))
            print(f"  {size:>7,} clusters done in {time.perf_counter() - t:.0f}s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print_table(rows)
    last = rows[-1]
    print_targets(last)
    if last.get("profile"):
        print(f"\nprofile of rank() over the dev queries at {last['clusters']:,} clusters:")
        print(last["profile"])
    print(f"\ntotal {time.perf_counter() - started:.0f}s")
    print(json.dumps({
        "clusters": last["clusters"],
        "build_s": round(last["build_s"], 3),
        "peak_rss_mb": round(last["peak_rss_mb"], 1),
        "p50_ms": round(last["p50_ms"], 3),
        "p99_ms": round(last["p99_ms"], 3),
        "speedup_vs_bruteforce": round(last["speedup_vs_bruteforce"], 1),
        "vs_bm25s": round(last["vs_bm25s"], 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
