"""End to end across many repositories (issue 17): the running bot on each store backend, a fake
GitHub that answers every call after a fixed latency and counts them, and a stream of signed
``issues.opened`` deliveries over many repositories at a fixed rate; beside it, on the same
deliveries and the same kind of fake, a bedevere-style peer, for the call count.

usage: python bench/e2e.py [--repos 5000] [--clusters-per-repo 100] [--active-repos 300]
                           [--index-memory-mb 1024] [--rate 20] [--seconds 60]
                           [--latency-ms 100] [--matched-share 0.5] [--repos-per-installation 1]
                           [--backends sqlite,postgresql] [--database-url URL] [--seed 0]
                           [--wait 60] [--keep] [--dump FILE]

The defaults are the issue's scale: 5,000 repositories with 100 learned clusters each in the
store (500,000 clusters), issues at 20 a second over 60 s; the table and the JSON say which
scale was run, and the table says when it was not the issue's.

**The bot.** ``python -m bot serve`` (receiver and worker in one process, default service
settings: 8 workers, 2 a repository), started by bench/webhook.py's ``Bench`` with App
credentials from a key pair made for the run, the webhook secret and a fresh store (a data
directory for SQLite; a new schema in ``--database-url`` for PostgreSQL, created before and
dropped after; skipped with one line when no server answers). Its service config names one
empty folder as its cluster files and sets ``repo_config_ttl`` (300 s, as config/bot.yml) and
``index_memory_mb`` (``--index-memory-mb``).

**The clusters.** Per repository, ``--clusters-per-repo`` learned clusters, written into the
store before the bot starts (in bulk, ``seed_learned``): the sample "Telegram /new confirm
button hangs" cluster (config/clusters/cluster-35994.json, the repository replaced, as
tests/test_multi_instance.py's ``repos_clusters`` does) and synthetic ones, shaped like the
sample clusters (an issue and its merged fix PR with files changed) with text drawn, seeded, from
a vocabulary of software words that excludes every word of the two issue texts below, so the
matched issue has one answer and the silent one none; every repository has the same ones under
its own name. Nothing is read from ../shared. The bot indexes a repository's clusters on its
first issue (that build is in the cold figures).

**The repositories.** ``--repos`` repositories ``e2e-org-NNNN/repo-NNNNN``; each owner is one
installation of ``--repos-per-installation`` repositories (default 1: every repository has an
installation of its own, so a cold repository also mints a token; with more, the token is
shared and only the first repository of an installation pays for it). Each repository has its own
``.github/dejafix.yml`` raising ``max_comments_per_day`` (the default 20 would silence a
repository's later issues); a repository without one costs one more cold read, its owner's
``.github`` repository.

**The deliveries.** ``rate * seconds`` signed ``issues.opened`` deliveries, a new issue number
each, sent at ``--rate`` a second, to ``--active-repos`` of the repositories (a seeded sample:
in a minute, a large installation hears from some of its repositories, not all). A share
``--matched-share`` has the text of tests/samples.py's RESET_HANG (answered with a
comment), the rest an unrelated text (silent).
New repositories are brought in at an even pace from the first delivery to the last; every other
delivery goes to a repository, picked at random, whose first delivery was sent at least 2 s
earlier (so that the first one has finished: a warm delivery finds the cache filled, not being
filled), or, in the first 2 s when there is none, to one of the repositories brought in. A
delivery is **cold** when it is its repository's first; **overlap** when that first one was sent
less than 2 s before (it may still be running; such deliveries are in the overall latency, not in
the warm or cold figures); **warm** when its repository had one within ``repo_config_ttl``
before; ``stale`` otherwise (never within the defaults).

**Latency**: from just before the delivery's POST to the fake's receipt of the comment POST for
its issue (so it holds the calls before the comment at ``--latency-ms`` each, not the comment's
own answer). p50 and p99 over every commented delivery; the cold figure over each cold
repository's first answer, compared with the warm p99.

**Calls**, counted by the fake: every request it received after the bot was ready (the GET /app
at start-up excluded), attributed to a delivery. A call naming an issue (``/repos/o/r/issues/N
/...``) is that issue's delivery's. A token request (``POST
/app/installations/I/access_tokens``, per installation) or any other call of a repository
(config, issue templates, releases; per path; a GraphQL query by the repository its variables
name): the first of its kind goes to the first delivery of that installation or repository (the
one that found nothing cached); one more than ``repo_config_ttl`` after the previous of its kind
(a cache that ran out) to the latest delivery sent before it; any other to the earliest delivery
sent since the previous one's that has none of its kind yet (the peer makes one of each per
delivery, with several deliveries of a repository in flight). Tokens are in each delivery's
calls and also shown apart; anything else is shown as unattributed. As a cross-check, the bot's
own ``dejafix_github_calls_per_delivery{kind}`` (GET /metrics, read at the end) is printed
beside the fake's counts by kind.

**Peak RSS**: every process of the bot (the serve process and its children, the index build
processes), sampled every 0.2 s from its spawn to its stop: the sum over the processes of each
one's VmHWM (as if they all peaked at once; shared pages counted in each) is the figure; the
largest simultaneous sum of VmRSS and the largest single process are shown too. The PostgreSQL
server's processes are not the bot's and are not counted.

**The peer**: a bedevere-style aiohttp app (``--peer``, in a process of its own, run once after
the bot's runs; it has no store) that handles each delivery within the webhook request: a new
installation token per delivery (gidgethub's ``apps.get_installation_access_token`` with the
App's JWT), ``.github/dejafix.yml`` read on every delivery, the issue's comments listed, then
the comment posted for a matched issue (matched: the RESET_HANG title; the peer is about calls,
not matching). The same deliveries, at the same rate, on a fresh fake with the same latency.

**Output**: a table per backend and one for the peer, the targets with met or MISSED, then, last,
one JSON line: ``{"runs": [one object per backend measured, with the issue's keys repos,
clusters_per_repo, rate_per_s, latency_p50_s, latency_p99_s, calls_per_matched_warm,
calls_per_silent_warm, calls_per_issue_cold, peer_calls_per_matched, peak_rss_mb,
cold_first_answer_p99_ms, backend, and targets_met], "peer": {...}, "targets_met": bool}``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import copy
import hashlib
import hmac
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.webhook import (  # noqa: E402
    APP_ID,
    DEFAULT_DATABASE_URL,
    SAMPLE_CLUSTERS,
    SECRET,
    Bench,
    FakeServer,
    JobCounts,
    PhaseFailed,
    Proc,
    Store,
    Stores,
    _f,
    _free_port,
    _pct,
    _proc_table,
    _table,
    cpu_seconds,
    headers_for,
    key_pair,
    reset_hang,
)

BACKENDS = ("sqlite", "postgresql")
ISSUE_REPOS = 5000
ISSUE_CLUSTERS = 100
# A repository gets its second delivery no sooner than this after its first.
WARM_AFTER = 2.0
CONFIG_TTL = 300.0
SILENT = {
    # tests/samples.py's UNRELATED: nothing in any repository is about it.
    "title": "Docs: add a dark theme to the documentation website",
    "body": "The docs site is very bright at night. A dark colour scheme would be nice.",
}
REPO_FILE = "max_comments_per_day: 10000\n"  # the most it takes
MATCHED_ID = "35994"

# Targets (issue 17).
T_P99_S = 1.5
T_P50_S = 0.4
T_WARM_MATCHED = 1.2
T_WARM_SILENT = 0.2
T_PEER_RATIO = 3.0
T_COLD = 3.0
T_RSS_MB = 2048.0
T_COLD_EXTRA_MS = 300.0


# --- the clusters ---------------------------------------------------------------------------

_VOCAB = """
accessor adapter aggregate alert allocator annotation archive argument artifact assertion
attachment audit avatar backoff backup badge balancer bandwidth banner batch benchmark binary
bitmap blob bookmark bound branch breadcrumb broker bucket buffer bundle cache calendar callback
canvas capacity caption catalog certificate changelog channel chart checkout checksum chunk
cipher classifier clipboard cluster codec collector column compiler compression connector
console constraint container contract converter cookie coordinate counter cron cursor dashboard
dataset deadline decoder dependency deployment descriptor diagram dialect digest directory
dispatcher document domain download driver dropdown editor element embedding emitter encoder
endpoint entity enum envelope exporter expression extension facet factory feature filter
firmware fixture flag folder font footer formatter fragment frame gauge generator glyph gradient
graph grid handler hash header heap histogram hook host icon identifier importer indexer
inspector installer interceptor interval inventory invoice iterator journal kernel keyboard
keychain label latch layout ledger lexer library license limiter linker listener locale locator
manifest mapper marker matrix membership menu merger metadata migration mirror modal module
monitor mount namespace navigator notifier offset optimizer option orchestrator overlay package
pagination palette panel parser partition patch payload permission pipeline pixel placeholder
planner plugin pointer policy portal predicate preview printer probe processor profile projector
prompt protocol provider proxy publisher quota ranker reader receipt recorder reducer referrer
registry renderer replica reporter repository resolver router sampler sandbox scheduler schema
scraper selector sensor serializer shard sidebar signature sitemap slider snapshot socket sorter
spinner splitter spreadsheet stack stencil storage stream subscriber suggestion switcher
tablet tagger template tenant terminal textarea thumbnail ticket timeline timer toggle tokenizer
toolbar tooltip tracker transcoder transformer tree trigger tunnel uploader validator variable
vector vendor viewer viewport voucher wallet watcher widget wizard workbook workspace wrapper
yielder zipper
"""
_VERBS = """
breaks crashes drops duplicates freezes hangs ignores leaks loses misreads mislabels overflows
overwrites rejects repeats resets skips stalls truncates corrupts misorders flickers
"""
_QUALIFIERS = """
after upgrade on startup under load when empty with unicode for large inputs on retry after
resize in offline mode on second run with custom locale behind proxy during import at midnight
"""


def _words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z][A-Za-z0-9]+", text)}


def vocabulary() -> tuple[list[str], list[str], list[str]]:
    """(nouns, verbs, qualifier words) without any word of the matched or the silent text, so
    a synthetic cluster never competes with the sample one, nor answers the silent issue."""
    banned = _words(" ".join(reset_hang().values())) | _words(" ".join(SILENT.values()))
    nouns = [w for w in _VOCAB.split() if w not in banned]
    verbs = [w for w in _VERBS.split() if w not in banned]
    quals = [w for w in _QUALIFIERS.split() if w not in banned]
    return nouns, verbs, quals


def synthetic_cluster(repo: str, k: int, rng: random.Random,
                      vocab: tuple[list[str], list[str], list[str]]) -> dict[str, Any]:
    """Cluster ``k`` of ``repo``: a closed issue and the merged PR that fixed it."""
    nouns, verbs, quals = vocab
    a, b, c = rng.sample(nouns, 3)
    verb = rng.choice(verbs)
    qual = " ".join(rng.sample(quals, 2))
    issue, pr = 200_000 + 2 * k, 200_001 + 2 * k
    day = f"2026-{1 + k % 12:02d}-{1 + k % 28:02d}T12:00:00+00:00"
    files = [f"{a}/{b}_{c}.py", f"tests/{a}/test_{b}_{c}.py"]
    return {
        "repo": repo,
        "public_id": str(issue),
        "display_label": f"{a.capitalize()} {b} {verb} {qual}",
        "summary": f"The {a} {b} {verb} {qual}; the {c} now checks the {b} before the {a} "
                   f"uses it.",
        "subsystem": a,
        "counts": {"members": 2, "open_issues": 0, "open_issues_distinct": 0, "open_prs": 0,
                   "closed_issues": 1, "merged_prs": 1, "attempt_prs": 0},
        "landed_fix": {"status": "merged_to_main", "basis": "structural", "pr": pr,
                       "merged_at": day},
        "resolution": {"state": "resolved", "by": f"pr-{pr}"},
        "freshness": {"state": "verified", "last_verified_at": day, "is_stale": False},
        "fix_edges": [{"issue_number": issue, "pr_number": pr, "tier": "verified",
                       "basis": "closing_ref", "confidence": 0.95,
                       "recoverable_from_timeline": True, "pr_merged_at": day}],
        "members": [
            {"kind": "issue", "number": issue, "url": None, "state": "closed",
             "title": f"{a.capitalize()} {b} {verb} {qual}"},
            {"kind": "pr", "number": pr, "url": None, "state": "merged",
             "title": f"fix({a}): {c} checks the {b} first (#{issue})",
             "close_reason": {"category": "merged"}, "merged": True, "is_fix_pr": True,
             "fix_tier": "verified", "files_changed": files},
        ],
    }


_REPO_MARK = "__E2E_REPO__"


def learned_records(per_repo: int, seed: int) -> list[str]:
    """The records one repository learned: the sample cluster and ``per_repo - 1`` synthetic
    ones, as JSON with a mark where the repository goes (every repository has the same
    clusters under its own name: 500,000 records are then written in seconds)."""
    sample = json.loads((SAMPLE_CLUSTERS / f"cluster-{MATCHED_ID}.json").read_text())
    vocab = vocabulary()
    rng = random.Random(seed)
    out = [json.dumps({**sample, "repo": _REPO_MARK})]
    for k in range(per_repo - 1):
        out.append(json.dumps(synthetic_cluster(_REPO_MARK, k, rng, vocab)))
    return out


def seed_learned(store: Store, repos: list[str], per_repo: int, seed: int) -> int:
    """Write ``per_repo`` learned clusters for each repository straight into the bot's store
    (migrated first by opening it as the bot does), in bulk: through ``put_learned`` one
    transaction and one notification each, 500,000 would take many minutes. Their members are
    not indexed (``learned_members``: the issues.opened path never reads it)."""
    from bot.db import open_store

    opened = open_store(store.data_dir, store.url, max_attempts=5)
    opened.close()
    templates = [(t, str(json.loads(t)["public_id"])) for t in learned_records(per_repo, seed)]
    now = time.time()

    def rows(repo: str) -> Iterable[tuple[str, str, str, float]]:
        low = repo.lower()
        for text, public_id in templates:
            yield low, public_id, text.replace(_REPO_MARK, repo), now

    n = 0
    if store.url is not None:
        import psycopg

        with psycopg.connect(store.url) as conn, conn.cursor() as cur, cur.copy(
                "COPY learned_clusters (repo, public_id, record, updated_at) FROM STDIN") as cp:
            for repo in repos:
                for row in rows(repo):
                    cp.write_row(row)
                    n += 1
    else:
        import sqlite3

        from bot.db.sqlite import DB_FILENAME

        lite = sqlite3.connect(store.data_dir / DB_FILENAME)
        try:
            with lite:
                for repo in repos:
                    batch = list(rows(repo))
                    lite.executemany("INSERT INTO learned_clusters (repo, public_id, record,"
                                     " updated_at) VALUES (?, ?, ?, ?)", batch)
                    n += len(batch)
        finally:
            lite.close()
    return n


# --- the deliveries -------------------------------------------------------------------------


@dataclass
class Delivery:
    serial: int
    at: float           # seconds after the start of the stream
    repo: str
    installation: int
    number: int
    matched: bool
    klass: str = ""     # cold, overlap, warm or stale
    sent: float = 0.0   # monotonic, just before the POST
    status: int = 0
    answer: str = ""
    calls: int = 0
    tokens: int = 0
    comment_at: float | None = None

    @property
    def latency(self) -> float | None:
        return None if self.comment_at is None else self.comment_at - self.sent


def repo_names(repos: int, per_installation: int) -> list[tuple[str, int]]:
    """(repository, installation id) for each repository: one owner per installation."""
    out = []
    for i in range(repos):
        owner = i // per_installation
        out.append((f"e2e-org-{owner:04d}/repo-{i:05d}", 1000 + owner))
    return out


def schedule(repos: list[tuple[str, int]], total: int, rate: float, matched_share: float,
             seed: int, ttl: float = CONFIG_TTL, warm_after: float = WARM_AFTER
             ) -> list[Delivery]:
    """The deliveries in order. New repositories are brought in evenly from the start
    (delivery ``i`` has brought in ``ceil((i + 1) * repos / total)``); each other delivery goes
    to a random repository whose first delivery is at least ``warm_after`` old, or, while there
    is none yet (the first seconds), to any repository brought in ("overlap": its first
    delivery may still be running)."""
    rng = random.Random(seed)
    firsts: list[float] = []  # first-delivery times of the repositories brought in, in order
    last: dict[int, float] = {}
    out: list[Delivery] = []
    for i in range(total):
        at = i / rate
        due = min(len(repos), math.ceil((i + 1) * len(repos) / total))
        ready = bisect.bisect_right(firsts, at - warm_after)
        if len(firsts) < due:
            r = len(firsts)
            firsts.append(at)
        elif ready:
            r = rng.randrange(ready)
        else:
            r = rng.randrange(len(firsts))
        previous = last.get(r)
        if previous is None:
            klass = "cold"
        elif at - firsts[r] < warm_after:
            klass = "overlap"
        else:
            klass = "warm" if at - previous <= ttl else "stale"
        last[r] = at
        repo, inst = repos[r]
        out.append(Delivery(i, at, repo, inst, 100_001 + i, rng.random() < matched_share,
                            klass))
    return out


def payload(d: Delivery, texts: dict[bool, dict[str, str]]) -> bytes:
    owner, name = d.repo.split("/")
    text = texts[d.matched]
    return json.dumps({
        "action": "opened",
        "issue": {"number": d.number, "title": text["title"], "body": text["body"],
                  "state": "open", "user": {"login": "reporter", "type": "User"},
                  "labels": [], "created_at": "2026-12-01T00:00:00Z"},
        "repository": {"full_name": d.repo, "name": name, "owner": {"login": owner},
                       "private": False},
        "sender": {"login": "reporter", "type": "User"},
        "installation": {"id": d.installation},
    }).encode()


# --- counting the fake's calls --------------------------------------------------------------


class TimedRequests(list):  # type: ignore[type-arg]
    """FakeGitHub.requests that also keeps when each request arrived (monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def append(self, item: Any) -> None:
        self.times.append(time.monotonic())
        super().append(item)


def _path_of(r: Any) -> str:
    """A request's path; a GraphQL query's names the repository its variables do (the bot's
    cold read of a repository's config and templates), so it is counted as that repository's."""
    if r.path == "/graphql" and isinstance(r.body, dict):
        variables = r.body.get("variables") or {}
        if variables.get("owner") and variables.get("name"):
            return f"/repos/{variables['owner']}/{variables['name']}/graphql"
    return str(r.path)


def _latest(items: list[tuple[float, Delivery]], t: float) -> Delivery | None:
    """The latest delivery sent at or before ``t`` (else the first)."""
    if not items:
        return None
    i = bisect.bisect_right(items, t, key=lambda x: x[0])
    return items[max(i - 1, 0)][1]


@dataclass
class _Seen:
    """The calls of one kind (a token of one installation, one path of one repository) so
    far: when the last one arrived, the delivery it went to, and every delivery given one."""

    last_at: float
    last: Delivery
    given: set[int] = field(default_factory=set)


def attribute(deliveries: list[Delivery], requests: Iterable[tuple[float, str, str]],
              ttl: float = CONFIG_TTL) -> dict[str, int]:
    """Add each request (arrival time, method, path) to its delivery's ``calls`` (and
    ``tokens``). Returns the unattributed requests by "METHOD path".

    A call naming an issue goes to that issue's delivery. A token (per installation) or any
    other call of a repository (per path) goes, when it is the first of its kind, to the first
    delivery of that installation or repository (the bot caches them: the cold delivery needed
    it); when it comes more than ``ttl`` after the previous one of its kind (a cache that ran
    out), to the latest delivery sent before it; else to the earliest delivery sent since the
    previous one's that has none of its kind yet (the peer makes one of each per delivery,
    and two deliveries of a repository may be in flight at once), else the latest."""
    by_number = {d.number: d for d in deliveries}
    by_repo: dict[str, list[tuple[float, Delivery]]] = {}
    by_inst: dict[int, list[tuple[float, Delivery]]] = {}
    for d in sorted(deliveries, key=lambda d: d.sent):
        by_repo.setdefault(d.repo.lower(), []).append((d.sent, d))
        by_inst.setdefault(d.installation, []).append((d.sent, d))
    seen: dict[tuple[Any, ...], _Seen] = {}
    other: dict[str, int] = {}

    def pick(kind: tuple[Any, ...], items: list[tuple[float, Delivery]], t: float
             ) -> Delivery | None:
        if not items:
            return None
        before = seen.get(kind)
        if before is None:
            target: Delivery | None = items[0][1]
        elif t - before.last_at > ttl:
            target = _latest(items, t)
        else:
            lo = bisect.bisect_right(items, before.last.sent, key=lambda x: x[0])
            hi = bisect.bisect_right(items, t, key=lambda x: x[0])
            target = next((d for _, d in items[lo:hi] if d.serial not in before.given),
                          None) or _latest(items, t)
        assert target is not None
        if before is None:
            before = seen[kind] = _Seen(t, target)
        before.last_at, before.last = t, target
        before.given.add(target.serial)
        return target

    for t, method, path in sorted(requests):
        parts = path.split("/")
        target: Delivery | None = None
        token = False
        if len(parts) == 5 and parts[1] == "app" and parts[2] == "installations" \
                and parts[4] == "access_tokens" and parts[3].isdigit():
            inst = int(parts[3])
            target = pick(("token", inst), by_inst.get(inst, []), t)
            token = True
        elif len(parts) > 3 and parts[1] == "repos":
            repo = f"{parts[2]}/{parts[3]}".lower()
            if len(parts) > 5 and parts[4] == "issues" and parts[5].isdigit():
                target = by_number.get(int(parts[5]))
                if target is not None and target.repo.lower() != repo:
                    target = None
            else:
                target = pick(("path", repo, method, path), by_repo.get(repo, []), t)
        if target is None:
            key = f"{method} {path}"
            other[key] = other.get(key, 0) + 1
            continue
        target.calls += 1
        target.tokens += token
    return other


# --- peak RSS -------------------------------------------------------------------------------


@dataclass
class RssSampler:
    """VmHWM and VmRSS of a process and its descendants, every ``every`` seconds."""

    root: int
    every: float = 0.2
    hwm_kb: dict[int, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    max_sum_rss_kb: int = 0
    samples: int = 0
    _task: asyncio.Task[None] | None = None

    @staticmethod
    def _status(pid: int) -> tuple[int, int] | None:
        try:
            with open(f"/proc/{pid}/status") as fh:
                text = fh.read()
        except OSError:
            return None
        values = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                values[key] = int(rest.split()[0])
        if "VmHWM" not in values:
            return None  # a zombie
        return values["VmHWM"], values.get("VmRSS", 0)

    def sample(self) -> None:
        table = _proc_table()
        tree = {self.root}
        grew = True
        while grew:
            children = {pid for pid, (parent, _, _) in table.items() if parent in tree} - tree
            grew = bool(children)
            tree |= children
        total = 0
        for pid in tree:
            got = self._status(pid)
            if got is None:
                continue
            hwm, rss = got
            self.hwm_kb[pid] = max(self.hwm_kb.get(pid, 0), hwm)
            if pid in table:
                self.names[pid] = table[pid][1]
            total += rss
        self.max_sum_rss_kb = max(self.max_sum_rss_kb, total)
        self.samples += 1

    async def _run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.every)

    def start(self) -> RssSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def figures(self) -> dict[str, Any]:
        return {
            "peak_rss_mb": sum(self.hwm_kb.values()) / 1024,
            "max_simultaneous_rss_mb": self.max_sum_rss_kb / 1024,
            "largest_process_mb": max(self.hwm_kb.values(), default=0) / 1024,
            "processes": len(self.hwm_kb),
            "samples": self.samples,
        }


# --- the bot's metric -----------------------------------------------------------------------

_HIST = re.compile(r'^dejafix_github_calls_per_delivery_(sum|count)\{kind="([^"]+)"\} (\S+)$')


def index_metrics(text: str) -> dict[str, int]:
    """The bot's per-repository index counts at the end: built, dropped for the budget,
    resident."""
    out = {}
    for key, name in (("builds", "dejafix_repo_index_builds_total"),
                      ("evictions", "dejafix_repo_index_evictions_total"),
                      ("resident", "dejafix_repo_indexes_resident"),
                      ("bytes", "dejafix_repo_index_bytes")):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        if m:
            out[key] = int(float(m.group(1)))
    return out


def learned_metric(text: str) -> int | None:
    m = re.search(r"^dejafix_learned_clusters (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else None


def calls_metric(text: str) -> dict[str, dict[str, float]]:
    """kind -> {"sum", "count"} of dejafix_github_calls_per_delivery."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _HIST.match(line.strip())
        if m:
            out.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    return out


# --- the peer (a child process) -------------------------------------------------------------


def serve_peer(port: int, github_url: str, matched_title: str) -> None:
    """A bedevere-style App: everything within the webhook request, nothing cached."""
    import aiohttp
    import gidgethub
    from aiohttp import web
    from gidgethub import apps
    from gidgethub.aiohttp import GitHubAPI

    private_key = os.environ["E2E_PEER_PRIVATE_KEY"]
    key = SECRET.encode()
    state: dict[str, Any] = {}

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        expected = "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(request.headers.get("X-Hub-Signature-256", ""), expected):
            return web.json_response({"error": "bad signature"}, status=401)
        data = json.loads(body)
        if request.headers.get("X-GitHub-Event") != "issues" or data.get("action") != "opened":
            return web.Response(status=200)
        session: aiohttp.ClientSession = state["session"]
        app_gh = GitHubAPI(session, "e2e-peer", base_url=github_url)
        token = await apps.get_installation_access_token(
            app_gh, installation_id=str(data["installation"]["id"]), app_id=APP_ID,
            private_key=private_key)
        gh = GitHubAPI(session, "e2e-peer", oauth_token=token["token"], base_url=github_url)
        repo = data["repository"]["full_name"]
        number = data["issue"]["number"]
        with contextlib.suppress(gidgethub.BadRequest):  # a 404: no config, the defaults
            await gh.getitem(f"/repos/{repo}/contents/.github/dejafix.yml")
        comments = [c async for c in gh.getiter(f"/repos/{repo}/issues/{number}/comments")]
        ours = any(c.get("user", {}).get("login", "").endswith("[bot]") for c in comments)
        if data["issue"]["title"] == matched_title and not ours:
            await gh.post(f"/repos/{repo}/issues/{number}/comments",
                          data={"body": "This looks like a bug with a landed fix."})
        return web.json_response({"status": "handled"})

    async def start(app: web.Application) -> Any:
        state["session"] = aiohttp.ClientSession()
        yield
        await state["session"].close()

    app = web.Application()
    app.router.add_post("/webhook", handle)
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_get("/healthz", healthz)
    app.cleanup_ctx.append(start)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- one run: the bot on a backend, or the peer ---------------------------------------------


@dataclass
class Run:
    name: str           # sqlite, postgresql, peer
    deliveries: list[Delivery]
    unattributed: dict[str, int]
    rss: dict[str, Any] | None
    metric: dict[str, dict[str, float]]
    jobs: dict[str, int]
    span_s: float
    clusters_loaded: int | None = None
    indexes: dict[str, int] = field(default_factory=dict)  # the bot's per-repository indexes
    # CPU % (100 = one core) over the run: the bot's (or the peer's) processes, PostgreSQL's
    # server processes, this process (the fake GitHub and the sender)
    cpu: dict[str, float] = field(default_factory=dict)


class E2E:
    def __init__(self, args: argparse.Namespace, workdir: Path, stores: Stores) -> None:
        self.args = args
        self.workdir = workdir
        self.stores = stores
        self.private, self.public = key_pair()
        self.bench = Bench(args, workdir, stores, self.private, self.public)
        self.repos = repo_names(args.repos, args.repos_per_installation)
        total = max(1, round(args.rate * args.seconds))
        # The repositories that get issues, spread over the store's (a seeded sample).
        self.active = random.Random(args.seed).sample(self.repos,
                                                      min(args.active_repos, len(self.repos)))
        self.plan = schedule(self.active, total, args.rate, args.matched_share, args.seed,
                             args.config_ttl)
        self.texts = {True: reset_hang(), False: SILENT}
        self.clusters = 0

    def prepare(self) -> None:
        # No cluster file: every cluster is a learned one, in the store (seeded per backend).
        empty = self.workdir / "no-cluster-files"
        empty.mkdir(exist_ok=True)
        config = self.workdir / "bot.yml"
        config.write_text(
            f"cluster_paths: [{json.dumps(str(empty))}]\n"
            "cluster_reload: 0\n"
            "stop_grace: 0\n"
            "drain_seconds: 5\n"
            f"index_memory_mb: {self.args.index_memory_mb:g}\n"
            f"repo_config_ttl: {self.args.config_ttl:g}\n")
        self.bench.config_path = config

    def seed(self, store: Store) -> None:
        t = time.perf_counter()
        self.clusters = seed_learned(store, [r for r, _ in self.repos],
                                     self.args.clusters_per_repo, self.args.seed)
        print(f"  {store.backend}: {self.clusters:,} learned clusters written to the store in "
              f"{time.perf_counter() - t:.1f}s", flush=True)

    async def fake(self) -> tuple[FakeServer, TimedRequests]:
        fake = await FakeServer(self.public, latency=self.args.latency_ms / 1000).start()
        timed = TimedRequests()
        fake.fake.requests = timed
        for repo, _ in self.repos:
            fake.fake.add_file(repo, ".github/dejafix.yml", REPO_FILE)
        return fake, timed

    async def send_all(self, url: str) -> list[Delivery]:
        import aiohttp

        plan = [copy.copy(d) for d in self.plan]
        loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def send(d: Delivery) -> None:
                body = payload(d, self.texts)
                d.sent = time.monotonic()
                try:
                    async with session.post(url, data=body, headers=headers_for(body)) as r:
                        d.status = r.status
                        d.answer = (await r.text())[:80]
                except (aiohttp.ClientError, TimeoutError) as exc:
                    d.answer = repr(exc)[:80]

            start = loop.time() + 0.1
            tasks = []
            for d in plan:
                await asyncio.sleep(max(0.0, start + d.at - loop.time()))
                tasks.append(asyncio.create_task(send(d)))
            await asyncio.gather(*tasks)
        return plan

    async def bot_run(self, backend: str) -> Run:
        import aiohttp

        store: Store = self.stores.fresh(backend)
        await asyncio.to_thread(self.seed, store)
        fake, timed = await self.fake()
        proc: Proc | None = None
        sampler: RssSampler | None = None
        try:
            proc = self.bench.bot(f"serve {backend} (e2e)", ["serve"], store, fake.url)
            sampler = RssSampler(proc.pid).start()
            await proc.wait_ready(timeout=300)
            base = f"http://127.0.0.1:{proc.port}"
            async with aiohttp.ClientSession() as session, \
                    session.get(base + "/metrics") as resp:
                loaded = learned_metric(await resp.text())
            if loaded != self.clusters:
                raise PhaseFailed(f"the bot sees {loaded} learned clusters of "
                                  f"{self.clusters}:\n" + proc.tail())
            skip = len(timed)  # GET /app at start-up
            t0 = time.monotonic()
            cpu0 = (*cpu_seconds([proc.pid]), time.process_time())
            plan = await self.send_all(base + "/webhook")
            jobs = await self._drain(store, proc, fake, plan)
            span = time.monotonic() - t0
            cpu = _cpu(cpu0, (*cpu_seconds([proc.pid]), time.process_time()), span)
            async with aiohttp.ClientSession() as session, \
                    session.get(base + "/metrics") as resp:
                text = await resp.text()
                metric = calls_metric(text)
                indexes = index_metrics(text)
            requests = [(timed.times[i], r.method, _path_of(r))
                        for i, r in enumerate(list(timed)) if i >= skip]
        finally:
            if sampler is not None:
                sampler.sample()
                await sampler.stop()
            if proc is not None:
                await self.bench.finish(proc)
            await fake.stop()
            self.stores.drop(store)
        for d in plan:
            d.comment_at = fake.arrivals.get((d.repo.lower(), d.number))
        other = attribute(plan, requests, self.args.config_ttl)
        return Run(backend, plan, other, sampler.figures() if sampler else None, metric,
                   jobs, span, loaded, cpu=cpu, indexes=indexes)

    async def _drain(self, store: Store, proc: Proc, fake: FakeServer,
                     plan: list[Delivery]) -> dict[str, int]:
        """Until every matched delivery is commented and no job is queued or running (or
        nothing is, and no comment came for 3 s: the missing ones are not coming)."""
        counts = JobCounts(store)
        want = {(d.repo.lower(), d.number) for d in plan if d.matched and d.status == 202}
        deadline = time.monotonic() + self.args.wait
        states: dict[str, int] = {}
        idle_since: float | None = None
        try:
            while time.monotonic() < deadline:
                if proc.popen.poll() is not None:
                    raise PhaseFailed(f"the bot exited ({proc.popen.returncode}):\n"
                                      + proc.tail())
                states = await counts.read()
                busy = sum(n for s, n in states.items() if s not in ("done", "failed"))
                if not busy and want <= fake.arrivals.keys():
                    break
                if busy:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > 3.0:
                    print("  every job finished; some matched deliveries got no comment",
                          flush=True)
                    break
                await asyncio.sleep(0.1)
            else:
                print(f"  not drained within --wait {self.args.wait:g}s: jobs {states}",
                      flush=True)
        finally:
            counts.close()
        return states

    async def peer_run(self) -> Run:
        fake, timed = await self.fake()
        port = _free_port()
        env = {**os.environ, "E2E_PEER_PRIVATE_KEY": self.private, "PYTHONPATH": str(ROOT)}
        proc = self.bench.spawn("peer", [sys.executable, str(Path(__file__).resolve()),
                                         "--peer", "--port", str(port), "--github-url",
                                         fake.url], env, port)
        try:
            await proc.wait_ready(timeout=60)
            t0 = time.monotonic()
            cpu0 = (*cpu_seconds([proc.pid]), time.process_time())
            plan = await self.send_all(f"http://127.0.0.1:{port}/webhook")
            span = time.monotonic() - t0
            cpu = _cpu(cpu0, (*cpu_seconds([proc.pid]), time.process_time()), span)
            requests = [(timed.times[i], r.method, r.path) for i, r in enumerate(list(timed))]
        finally:
            await self.bench.finish(proc)
            await fake.stop()
        for d in plan:
            d.comment_at = fake.arrivals.get((d.repo.lower(), d.number))
        other = attribute(plan, requests, self.args.config_ttl)
        return Run("peer", plan, other, None, {}, {}, span, cpu=cpu)


def _cpu(before: tuple[float, float, float], after: tuple[float, float, float], span: float
         ) -> dict[str, float]:
    names = ("server", "postgres", "bench")
    return {n: 100.0 * (b - a) / span for n, a, b in zip(names, before, after, strict=True)} \
        if span > 0 else {}


# --- the report -----------------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(run: Run) -> dict[str, Any]:
    ds = run.deliveries
    groups: dict[str, list[Delivery]] = {}
    for d in ds:
        groups.setdefault(f"{d.klass} {'matched' if d.matched else 'silent'}", []).append(d)

    def calls(group: Iterable[Delivery]) -> float | None:
        return _mean([float(d.calls) for d in group])

    answered = [d.latency for d in ds if d.latency is not None]
    warm_lat = [d.latency for d in ds if d.latency is not None and d.klass == "warm"]
    cold_lat = [d.latency for d in ds if d.latency is not None and d.klass == "cold"]
    p99_warm = _pct(warm_lat, 0.99)
    p99_cold = _pct(cold_lat, 0.99)
    return {
        "groups": groups,
        "answered": len(answered),
        "matched": sum(d.matched for d in ds),
        "not_accepted": sum(1 for d in ds if d.status not in (200, 202)),
        "missing": sum(1 for d in ds if d.matched and d.latency is None),
        "unexpected": sum(1 for d in ds if not d.matched and d.latency is not None),
        "p50": _pct(answered, 0.5),
        "p99": _pct(answered, 0.99),
        "warm_p50": _pct(warm_lat, 0.5),
        "warm_p99": p99_warm,
        "cold_p50": _pct(cold_lat, 0.5),
        "cold_p99": p99_cold,
        "cold_extra_ms": (p99_cold - p99_warm) * 1000
        if p99_cold is not None and p99_warm is not None else None,
        "warm_matched": calls(d for d in ds if d.klass == "warm" and d.matched),
        "warm_silent": calls(d for d in ds if d.klass == "warm" and not d.matched),
        "cold": calls(d for d in ds if d.klass == "cold"),
        "matched_all": calls(d for d in ds if d.matched),
        "silent_all": calls(d for d in ds if not d.matched),
        "total_calls": sum(d.calls for d in ds) + sum(run.unattributed.values()),
        "tokens": sum(d.tokens for d in ds),
    }


def _ms(value: float | None) -> str:
    return _f(None if value is None else value * 1000)


def print_run(run: Run, s: dict[str, Any], args: argparse.Namespace) -> None:
    title = f"the bot, python -m bot serve, {run.name}" if run.name != "peer" else \
        "the peer: bedevere-style (token minted, config read and comments listed per delivery)"
    print(f"\n=== {title} " + "=" * max(0, 96 - len(title)))
    issue_scale = args.repos >= ISSUE_REPOS and args.clusters_per_repo >= ISSUE_CLUSTERS
    print(f"  scale run: {args.repos:,} repositories x {args.clusters_per_repo} clusters "
          f"({args.repos * args.clusters_per_repo:,} clusters"
          + (f", {run.clusters_loaded:,} in the store, seen by the bot"
             if run.clusters_loaded else "")
          + f"), {len(run.deliveries):,} deliveries at {args.rate:g}/s for {args.seconds:g}s, "
          f"fake GitHub {args.latency_ms:g} ms an answer, {args.repos_per_installation} "
          f"repositor{'y' if args.repos_per_installation == 1 else 'ies'} an installation")
    if not issue_scale:
        print(f"  NOT the issue's scale ({ISSUE_REPOS:,} repositories x {ISSUE_CLUSTERS} "
              f"clusters)")
    rows = []
    order = [f"{k} {m}" for k in ("cold", "overlap", "warm", "stale")
             for m in ("matched", "silent")]
    for name in order:
        group = s["groups"].get(name)
        if not group:
            continue
        lat = [d.latency for d in group if d.latency is not None]
        tokens = sum(d.tokens for d in group)
        rows.append([
            name, f"{len(group):,}", f"{len(lat):,}",
            _f(_mean([float(d.calls) for d in group]), ".2f"),
            _f(tokens / len(group), ".2f"),
            _f(_mean([float(d.calls - d.tokens) for d in group]), ".2f"),
            _ms(_pct(lat, 0.5)), _ms(_pct(lat, 0.99)), _ms(max(lat) if lat else None),
        ])
    _table(["deliveries", "n", "commented", "calls/issue", "of which tokens",
            "without tokens", "p50 ms", "p99 ms", "max ms"], rows)
    print(f"  all: {len(run.deliveries):,} sent, {s['answered']:,} of {s['matched']:,} matched "
          f"commented, latency p50 {_ms(s['p50'])} ms, p99 {_ms(s['p99'])} ms; "
          f"{s['total_calls']:,} calls ({s['tokens']:,} tokens) in {run.span_s:.0f}s")
    if s["not_accepted"] or s["missing"] or s["unexpected"]:
        bad: dict[str, int] = {}
        for d in run.deliveries:
            if d.status not in (200, 202):
                bad[f"{d.status} {d.answer[:40]}"] = bad.get(f"{d.status} {d.answer[:40]}",
                                                             0) + 1
        print(f"  PROBLEMS: {s['not_accepted']} not accepted {bad or ''}, {s['missing']} "
              f"matched without a comment, {s['unexpected']} silent ones commented; jobs "
              f"{run.jobs}")
    if run.cpu:
        who = "peer" if run.name == "peer" else "bot"
        print(f"  CPU over the run (100 = one core): {who} {run.cpu['server']:.0f}%, "
              + (f"PostgreSQL server {run.cpu['postgres']:.0f}%, " if run.name == "postgresql"
                 else "")
              + f"this process (fake GitHub, sender) {run.cpu['bench']:.0f}%")
    if run.unattributed:
        print(f"  unattributed calls: {dict(sorted(run.unattributed.items())[:5])}")
    if run.rss is not None:
        r = run.rss
        print(f"  peak RSS: {r['peak_rss_mb']:,.0f} MB, the sum of each process's VmHWM over "
              f"{r['processes']} process(es) (largest {r['largest_process_mb']:,.0f} MB; "
              f"largest simultaneous VmRSS sum {r['max_simultaneous_rss_mb']:,.0f} MB; "
              f"{r['samples']} samples)")
    if run.indexes:
        i = run.indexes
        print(f"  per-repository indexes (index_memory_mb {args.index_memory_mb:g}): "
              f"{i.get('builds', 0):,} built, {i.get('evictions', 0):,} dropped for the "
              f"budget, {i.get('resident', 0):,} resident at the end "
              f"({i.get('bytes', 0) / 2**20:,.1f} MB)")
    if run.metric:
        parts = []
        for kind in sorted(run.metric):
            m = run.metric[kind]
            count, total = m.get("count", 0.0), m.get("sum", 0.0)
            fake_group = [d for d in run.deliveries
                          if ("opened_matched" if d.matched else "opened_silent") == kind]
            fake_total = sum(d.calls for d in fake_group)
            parts.append(f"{kind}: bot {total:,.0f} calls / {count:,.0f} deliveries = "
                         f"{_f(total / count if count else None, '.2f')}; fake "
                         f"{fake_total:,} / {len(fake_group):,} = "
                         f"{_f(fake_total / len(fake_group) if fake_group else None, '.2f')}")
        print("  cross-check, dejafix_github_calls_per_delivery (GET /metrics) vs the fake's "
              "count:\n    " + "\n    ".join(parts))


def targets(s: dict[str, Any], peer: dict[str, Any] | None, rss: dict[str, Any] | None
            ) -> list[tuple[str, float | None, str, bool]]:
    """(figure, value, target text, met)."""
    peer_matched = peer["matched_all"] if peer else None
    warm = s["warm_matched"]
    ratio = peer_matched / warm if peer_matched and warm else (
        math.inf if peer_matched and warm == 0 else None)
    rss_mb = rss["peak_rss_mb"] if rss else None

    def at_most(v: float | None, limit: float) -> bool:
        return v is not None and v <= limit

    return [
        ("delivery->comment p99 s", s["p99"], f"<= {T_P99_S:g}", at_most(s["p99"], T_P99_S)),
        ("delivery->comment p50 s", s["p50"], f"<= {T_P50_S:g}", at_most(s["p50"], T_P50_S)),
        ("warm calls / matched", warm, f"<= {T_WARM_MATCHED:g}",
         at_most(warm, T_WARM_MATCHED)),
        ("warm calls / silent", s["warm_silent"], f"<= {T_WARM_SILENT:g}",
         at_most(s["warm_silent"], T_WARM_SILENT)),
        ("peer / ours, matched (warm)", ratio, f">= {T_PEER_RATIO:g}x",
         ratio is not None and ratio >= T_PEER_RATIO),
        ("cold calls / issue", s["cold"], f"<= {T_COLD:g}", at_most(s["cold"], T_COLD)),
        ("peak RSS MB", rss_mb, f"<= {T_RSS_MB:g}", at_most(rss_mb, T_RSS_MB)),
        ("cold first answer p99 - warm p99 ms", s["cold_extra_ms"], f"<= {T_COLD_EXTRA_MS:g}",
         at_most(s["cold_extra_ms"], T_COLD_EXTRA_MS)),
    ]


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or math.isinf(value) else round(value, digits)


async def run(args: argparse.Namespace) -> int:
    import aiohttp

    started = time.perf_counter()
    load = os.getloadavg()
    total = max(1, round(args.rate * args.seconds))
    print(f"bench/e2e.py: {os.cpu_count()} cores, load average {load[0]:.2f} at start; Python "
          f"{platform.python_version()}, aiohttp {aiohttp.__version__}; {args.repos:,} "
          f"repositories x {args.clusters_per_repo} clusters, {total:,} deliveries at "
          f"{args.rate:g}/s ({args.matched_share:.0%} matched), fake GitHub "
          f"{args.latency_ms:g} ms an answer; backends {', '.join(args.backends)}", flush=True)
    if load[0] > 0.5:
        print("  note: the machine is busy; latencies are higher than on an idle machine",
              flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="dejafix-e2e-"))
    stores = Stores(workdir, args.database_url)
    backends = list(args.backends)
    skipped: dict[str, str] = {}
    failures: list[str] = []
    if "postgresql" in backends:
        why = stores.check_postgres()
        if why is not None:
            print(f"  postgresql: skipped, no server at {args.database_url}: {why}", flush=True)
            backends.remove("postgresql")
            skipped["postgresql"] = why
    e2e = E2E(args, workdir, stores)
    classes: dict[str, int] = {}
    for d in e2e.plan:
        key = f"{d.klass} {'matched' if d.matched else 'silent'}"
        classes[key] = classes.get(key, 0) + 1
    print(f"  deliveries by kind: {dict(sorted(classes.items()))}", flush=True)
    runs: list[Run] = []
    peer_run: Run | None = None
    try:
        e2e.prepare()
        for backend in backends:
            print(f"\n{backend}: starting the bot, then {total:,} deliveries over "
                  f"{args.seconds:g}s", flush=True)
            try:
                r = await e2e.bot_run(backend)
            except PhaseFailed as exc:
                print(f"  FAILED: {exc}", flush=True)
                failures.append(f"{backend}: {str(exc).splitlines()[0]}")
                continue
            runs.append(r)
            s = summarise(r)
            print(f"  {s['answered']:,} commented, p50 {_ms(s['p50'])} ms, p99 "
                  f"{_ms(s['p99'])} ms, {s['total_calls']:,} calls", flush=True)
        print(f"\npeer: {total:,} deliveries over {args.seconds:g}s", flush=True)
        try:
            peer_run = await e2e.peer_run()
        except PhaseFailed as exc:
            print(f"  FAILED: {exc}", flush=True)
            failures.append(f"peer: {str(exc).splitlines()[0]}")
    finally:
        stores.close()
        if args.keep:
            print(f"\nlogs and data kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    peer = summarise(peer_run) if peer_run is not None else None
    if args.dump:
        with open(args.dump, "w") as out:
            for r in [*runs, *([peer_run] if peer_run is not None else [])]:
                for d in r.deliveries:
                    out.write(json.dumps({
                        "run": r.name, "serial": d.serial, "at": d.at, "repo": d.repo,
                        "installation": d.installation, "number": d.number,
                        "matched": d.matched, "class": d.klass, "status": d.status,
                        "calls": d.calls, "tokens": d.tokens,
                        "latency_s": _r(d.latency, 4)}) + "\n")
        print(f"  every delivery written to {args.dump}")
    out_runs = []
    met_all = bool(runs) and not failures
    for r in runs:
        s = summarise(r)
        print_run(r, s, args)
    if peer_run is not None and peer is not None:
        print_run(peer_run, peer, args)
    for r in runs:
        s = summarise(r)
        print(f"\ntargets, {r.name}:")
        checks = targets(s, peer, r.rss)
        for name, value, want, met in checks:
            text = "-" if value is None else ("inf" if math.isinf(value) else f"{value:,.2f}")
            print(f"  {name:<38} {text:>9}   target {want:<9} {'met' if met else 'MISSED'}")
        met_all &= all(met for *_, met in checks)
        if not (args.repos >= ISSUE_REPOS and args.clusters_per_repo >= ISSUE_CLUSTERS):
            print(f"  (at {args.repos:,} x {args.clusters_per_repo}, not the issue's "
                  f"{ISSUE_REPOS:,} x {ISSUE_CLUSTERS})")
        out_runs.append({
            "repos": args.repos,
            "clusters_per_repo": args.clusters_per_repo,
            "rate_per_s": args.rate,
            "latency_p50_s": _r(s["p50"]),
            "latency_p99_s": _r(s["p99"]),
            "calls_per_matched_warm": _r(s["warm_matched"]),
            "calls_per_silent_warm": _r(s["warm_silent"]),
            "calls_per_issue_cold": _r(s["cold"]),
            "peer_calls_per_matched": _r(peer["matched_all"]) if peer else None,
            "peak_rss_mb": _r(r.rss["peak_rss_mb"], 1) if r.rss else None,
            "cold_first_answer_p99_ms": _r(s["cold_p99"] * 1000, 1)
            if s["cold_p99"] is not None else None,
            "backend": r.name,
            "warm_p99_ms": _r(s["warm_p99"] * 1000, 1) if s["warm_p99"] is not None else None,
            "index_builds": r.indexes.get("builds"),
            "index_evictions": r.indexes.get("evictions"),
            "index_resident_mb": _r(r.indexes.get("bytes", 0) / 2**20, 1),
            "seconds": args.seconds,
            "latency_ms": args.latency_ms,
            "deliveries": len(r.deliveries),
            "commented": s["answered"],
            "targets_met": all(met for *_, met in checks),
        })
    for backend, why in skipped.items():
        print(f"\n{backend}: not measured ({why})")
    for failure in failures:
        print(f"FAILED: {failure}")
    problems = e2e.bench.problems
    if problems:
        print("\nWARNING/ERROR lines in the processes' logs:")
        for name, lines in problems.items():
            print(f"  {name}: {len(lines)} line(s), e.g.")
            for line in list(dict.fromkeys(lines))[:3]:
                print(f"    {line[:220]}")
    else:
        print("\nno WARNING or ERROR line in any process's log")
    print(f"\ntotal {time.perf_counter() - started:.0f}s")
    print(json.dumps({
        "runs": out_runs,
        "peer": {"calls_per_matched": _r(peer["matched_all"]),
                 "calls_per_silent": _r(peer["silent_all"]),
                 "latency_p50_s": _r(peer["p50"]), "latency_p99_s": _r(peer["p99"])}
        if peer else None,
        "issue_scale": args.repos >= ISSUE_REPOS and args.clusters_per_repo >= ISSUE_CLUSTERS,
        "targets_met": met_all,
    }))
    return 1 if failures or not runs else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/e2e.py",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repos", type=int, default=ISSUE_REPOS,
                        help="repositories with learned clusters in the store")
    parser.add_argument("--clusters-per-repo", type=int, default=ISSUE_CLUSTERS)
    parser.add_argument("--active-repos", type=int, default=300,
                        help="of them, how many get issues during the run")
    parser.add_argument("--index-memory-mb", type=float, default=1024.0)
    parser.add_argument("--rate", type=float, default=20.0, help="deliveries a second")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--latency-ms", type=float, default=100.0,
                        help="the fake GitHub's delay on every answer")
    parser.add_argument("--matched-share", type=float, default=0.5,
                        help="share of the deliveries with the matched text")
    parser.add_argument("--repos-per-installation", type=int, default=1)
    parser.add_argument("--config-ttl", type=float, default=CONFIG_TTL,
                        help="the bot's repo_config_ttl; also what makes a repository warm")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL,
                        help="PostgreSQL server; a schema is created in it and dropped")
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for the last answers after the last delivery")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the logs and data")
    parser.add_argument("--dump", metavar="FILE",
                        help="write every delivery of every run as a JSON line to FILE")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--github-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        serve_peer(args.port, args.github_url, reset_hang()["title"])
        return 0
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.backends or set(args.backends) - set(BACKENDS):
        parser.error(f"--backends: one or more of {', '.join(BACKENDS)}")
    if args.repos < 1 or args.clusters_per_repo < 1 or args.rate <= 0 or args.seconds <= 0 \
            or args.repos_per_installation < 1 or not 0 <= args.matched_share <= 1:
        parser.error("--repos, --clusters-per-repo, --repos-per-installation >= 1; --rate, "
                     "--seconds > 0; --matched-share in [0, 1]")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
