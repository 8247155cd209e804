"""Backfill (issue 26): the API calls and minutes to learn a repository's history over GraphQL,
against the REST walk on the same history, and the live issue→comment latency while it runs.

usage: python bench/backfill.py [--prs 10000] [--closing-prs 3000] [--issues 4000]
                                [--duplicates 500] [--latency-ms 100] [--seed 0]
                                [--live-seconds-max 600] [--no-live]

**The history** (``generate_history``, seeded, in tests/fake_github.py's ``FakeGitHub``): ``--prs``
merged pull requests (plus one closed unmerged PR in 20, which the REST listing also pages
through), ``--closing-prs`` of them closing ``--issues`` issues between them (most one issue, a
third two, one PR twelve: more than one GraphQL page of closing references). How a fix names its
issues, per PR: 80% a closing keyword GitHub also links, 10% linked only (no keyword), 10% a
keyword GitHub did not link (a fix merged into another branch: the GraphQL walk looks those up);
2% of fixes also say "fixes #N" of a pull request, 1% link another repository's issue. 1% of
the fixes re-fix an issue fixed earlier, 1 PR in 200 reverts an earlier fix. ``--duplicates``
issues are closed as duplicates ("Duplicate of #N" comment, as GitHub writes it), 4% with more
than ten comments after it, 4% of an issue no fix closed. Plus as many closed-not-planned issues
as duplicates, and open ones.

**Files per PR** are an ASSUMPTION, not measured from any repository: a lognormal with median 3
and sigma 1.25 (mean about 6.5, 0.4% above 100 files: a few dozen PRs in 10,000 need a second
files page), capped at 3,000 as GitHub lists. That shape (most PRs touch a handful of files, a
long tail of sweeping ones) is the one commonly reported for pull request sizes; its parameters
here are chosen, not fitted.

**The runs.** Each walk runs against its own fake GitHub answering every call after
``--latency-ms`` (``latency``), on a fresh SQLite store, through the real ``RepoClient``:
1. GraphQL, paths first (the default): every cluster learned with its fix's paths (pulls, then
   duplicates), then the diffs phase reads each learned fix's files over REST with their patches,
   8 at a time (GraphQL has no patches). Timed twice: to the end of the clusters-learned phase
   (the issue's target figures, ``calls`` and ``minutes``: the repository is matched on files,
   titles and bodies from then on) and to the end of the diffs (``calls_with_diffs``,
   ``minutes_with_diffs``).
2. REST (``graphql=False``) at latency 0, for its clusters and its call count (at 100 ms a call it
   would take about half an hour); its minutes are its calls x the latency, sequential as it is,
   and the output says so.
Clusters are compared record by record: at the end of run 1 they must equal REST exactly; at its
phase boundary they equal REST with the fix PRs' diff hunks left out (the only difference).

**Live latency** (``live_p99_s``): during run 1 (both phases), ``python -m bot serve`` (started as
bench/webhook.py's ``Bench`` does it, App credentials and webhook secret made for the run) on the
same fake GitHub, with the backfill's clusters store; an ``issues.opened`` delivery with the text
of the sample "Telegram /new confirm button hangs" bug (a curated cluster file, so it is answered
while the backfill writes) every second, timed from its POST to the fake's receipt of the comment.

The last line is one JSON object: ``prs, calls, calls_per_100_prs, minutes, clusters,
clusters_rest, live_p99_s`` (calls and minutes to the end of the clusters-learned phase),
``calls_with_diffs, minutes_with_diffs`` (to the end of the run) and the REST run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.webhook import APP_ID, FakeServer, _free_port, key_pair  # noqa: E402 (run as a script: the root first)

REPO = "bench-org/history"
OTHER_REPO = "bench-org/elsewhere"
FIRST_PR = 100_000


@dataclass
class History:
    prs: int
    merged: int
    closing_prs: int
    closings: int
    duplicates: int
    big_prs: int
    max_files: int


def files_per_pr(rng: random.Random) -> int:
    """ASSUMPTION (see the module text): lognormal, median 3, sigma 1.25, 1..3000."""
    return max(1, min(3000, round(rng.lognormvariate(math.log(3), 1.25))))


def generate_history(fake: Any, *, prs: int = 10_000, closing_prs: int = 3_000,
                     issues: int = 4_000, duplicates: int = 500, seed: int = 0,
                     repo: str = REPO) -> History:
    """A repository's history in ``fake`` (a FakeGitHub): see the module text."""
    rng = random.Random(seed)
    key = repo.lower()
    day = 0

    def stamp() -> str:
        nonlocal day
        day += 1
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(1_500_000_000 + day * 3600))

    words = ["exporter", "queue", "flush", "resize", "render", "cache", "token", "retry",
             "parser", "socket", "upload", "widget", "schema", "cursor", "thread", "timeout"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    # Issues fixed by the closing PRs: one PR twelve, a third of the rest two, the others one.
    twelve = 1 if closing_prs and issues >= 12 else 0
    two = max(0, min(closing_prs - twelve, issues - 12 * twelve - (closing_prs - twelve)))
    one = closing_prs - twelve - two
    next_issue = 1
    fixed: list[int] = []

    def new_issue(state_reason: str | None = "completed", state: str = "closed") -> int:
        nonlocal next_issue
        number = next_issue
        next_issue += 1
        fake.add_issue(repo, {
            "number": number, "title": f"{text(4)} fails ({number})", "body": text(30),
            "state": state, "state_reason": state_reason if state == "closed" else None,
            "created_at": stamp(), "html_url": f"https://github.com/{repo}/issues/{number}"})
        return number

    sizes = [12] * twelve + [2] * two + [1] * one
    rng.shuffle(sizes)
    closing_at = set(rng.sample(range(prs), closing_prs))
    pulls: list[dict[str, Any]] = []
    number = FIRST_PR
    big = 0
    most = 0
    closings = 0
    for i in range(prs):
        number += 1
        if rng.random() < 0.05:  # closed unmerged: listed by REST, not learned
            pulls.append({"number": number, "title": text(5), "body": "", "merged_at": None,
                          "state": "closed"})
            number += 1
        body = text(20)
        title = f"{text(4)} ({number})"
        if i in closing_at:
            targets = [new_issue() for _ in range(sizes.pop())]
            if fixed and rng.random() < 0.01:  # a second fix of an earlier bug
                targets = [rng.choice(fixed)]
            fixed.extend(targets)
            closings += len(targets)
            style = rng.random()
            if style < 0.8 or len(targets) > 10:
                body += "\n" + "\n".join(f"Fixes #{t}" for t in targets[:10])
                fake.closing_refs[(key, number)] = list(targets)
            elif style < 0.9:
                fake.closing_refs[(key, number)] = list(targets)
            else:
                body += "\n" + " ".join(f"closes #{t}" for t in targets)
            if rng.random() < 0.02:
                body += f"\nAlso fixes #{number - 1}"  # a pull request: not a bug report
                fake.add_issue(repo, {"number": number - 1, "title": "a PR", "state": "closed",
                                      "pull_request": {}})
            if rng.random() < 0.01:
                fake.closing_refs.setdefault((key, number), []).append(
                    f"{OTHER_REPO}#{targets[0]}")
        elif fixed and rng.random() < 0.005:
            title = f'Revert "{text(3)} (#{number - 7})"'
            body = f"Reverts {repo}#{rng.choice([p['number'] for p in pulls[-50:]])}"
        files = files_per_pr(rng)
        big += files > 100
        most = max(most, files)
        fake.pr_files[(key, number)] = [
            {"filename": f"src/{rng.choice(words)}/{rng.choice(words)}_{number}_{f}.py",
             "patch": f"@@ -1,2 +1,2 @@ def {rng.choice(words)}_{f}(self):\n-    old()\n"
                      f"+    {rng.choice(words)}_call_{number % 97}()"}
            for f in range(files)]
        pulls.append({"number": number, "title": title, "body": body, "state": "closed",
                      "merged_at": stamp(),
                      "html_url": f"https://github.com/{repo}/pull/{number}"})
    fake.pulls[key] = pulls
    for _ in range(duplicates):
        dup = new_issue("duplicate")
        target = rng.choice(fixed) if fixed and rng.random() > 0.04 else new_issue("not_planned")
        said = [{"id": dup * 100, "body": f"Duplicate of #{target}"}]
        if rng.random() < 0.04:  # a long thread after the close
            said += [{"id": dup * 100 + k, "body": text(6)} for k in range(1, 15)]
        fake.comments[(key, dup)] = said
    for _ in range(duplicates):
        new_issue("not_planned")
        new_issue(state="open")
    return History(prs=len(pulls), merged=prs, closing_prs=closing_prs, closings=closings,
                   duplicates=duplicates, big_prs=big, max_files=most)


# -- runs ---------------------------------------------------------------------------------------

class Fake(FakeServer):
    """bench/webhook.py's fake GitHub on loopback (it stamps the first comment POST on each
    issue), holding the history and counting the repository's calls (token mints left out)."""

    def __init__(self, public_pem: str, latency: float, args: argparse.Namespace) -> None:
        super().__init__(public_pem, latency)
        self.history = generate_history(self.fake, prs=args.prs, closing_prs=args.closing_prs,
                                        issues=args.issues, duplicates=args.duplicates,
                                        seed=args.seed)

    def calls(self) -> int:
        return sum(1 for r in self.fake.requests if REPO in r.path or (
            r.path == "/graphql" and isinstance(r.body, dict)
            and "DejafixBackfill" in str(r.body.get("query", ""))) or (
            r.path == "/graphql" and isinstance(r.body, dict)
            and (r.body.get("variables") or {}).get("name") == REPO.split("/")[1]))


@dataclass
class Run:
    """One backfill's figures: at the end, and when every cluster was learned (the boundary
    between the clusters-learned phases and the diffs phase)."""

    clusters: dict[str, dict[str, Any]]
    seconds: float
    calls: int
    learned_clusters: dict[str, dict[str, Any]]
    learned_seconds: float
    learned_calls: int


async def backfill(fake: Fake, private_pem: str, data: Path, **options: Any) -> Run:
    """One backfill of the history, timed at its phase boundary and at its end."""
    import aiohttp

    from bot.db.sqlite import SQLiteStore
    from bot.features.backfill import Backfill, BackfillProgress
    from bot.github.app import GitHubApp
    from bot.github.client import RepoClient
    from bot.settings import PrivateKey

    store = SQLiteStore(data)
    boundary: dict[str, Any] = {}

    def watch(progress: BackfillProgress) -> None:
        if progress.clusters_at is not None and not boundary:
            # Read here, at the boundary: the figures stop before the store is read.
            boundary["seconds"] = time.monotonic() - start
            boundary["calls"] = fake.calls() - before
            boundary["clusters"] = {c.public_id: c.model_dump()
                                    for c in store.learned_clusters(REPO)}
            boundary["read"] = time.monotonic() - start - boundary["seconds"]

    try:
        before = fake.calls()
        async with aiohttp.ClientSession() as session:
            app = GitHubApp(session, base_url=fake.url, app_id=APP_ID,
                            private_key=PrivateKey(private_pem, source="bench"))
            client = RepoClient(await app.for_installation(1), REPO)
            start = time.monotonic()
            await Backfill(client, store, REPO, progress=watch, **options).run()
            # The snapshot's read at the boundary is not the backfill's time.
            seconds = time.monotonic() - start - boundary.get("read", 0.0)
        clusters = {c.public_id: c.model_dump() for c in store.learned_clusters(REPO)}
        return Run(clusters, seconds, fake.calls() - before, boundary.get("clusters", clusters),
                   boundary.get("seconds", seconds), boundary.get("calls", 0))
    finally:
        store.close()


def without_hunks(clusters: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {**c, "members": [{**m, "fix_hunks": []} for m in c["members"]]}
            for k, c in clusters.items()}


# -- live latency -------------------------------------------------------------------------------

class Live:
    """``python -m bot serve`` on the fake, sent an issue a second while the backfill runs."""

    def __init__(self, fake: Fake, private_pem: str, workdir: Path) -> None:
        self.fake = fake
        self.private_pem = private_pem
        self.workdir = workdir
        self.port = _free_port()
        self.proc: Any = None
        self.latencies: list[float] = []
        self.unanswered = 0
        self.secret = "bench-backfill-secret"
        self.repo = REPO
        self.text: dict[str, str] = {}
        self.log_path = workdir / "serve.log"

    async def start(self, data_dir: Path) -> None:
        import aiohttp

        from bench.webhook import CLUSTER_REPO, SAMPLE_CLUSTERS, reset_hang

        self.repo = CLUSTER_REPO
        config = self.workdir / "bot.yml"
        config.write_text(f"cluster_paths: [{json.dumps(str(SAMPLE_CLUSTERS))}]\n"
                          "cluster_reload: 0\nstop_grace: 0\ndrain_seconds: 5\n")
        # The daily cap (20 new comments a repository) would silence the later deliveries.
        self.fake.fake.add_file(CLUSTER_REPO, ".github/dejafix.yml",
                                "max_comments_per_day: 10000\n")
        self.text = reset_hang()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("DEJAFIX_") and k not in ("PORT", "DATABASE_URL")}
        # The backfill's own SQLite store: the server runs beside it, as it would in production.
        env.update({"DEJAFIX_APP_ID": APP_ID, "DEJAFIX_PRIVATE_KEY": self.private_pem,
                    "DEJAFIX_WEBHOOK_SECRET": self.secret, "DEJAFIX_GITHUB_URL": self.fake.url,
                    "DEJAFIX_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": str(ROOT)})
        self.log_path = self.workdir / "serve.log"
        with self.log_path.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bot", "serve", "--port", str(self.port), "--config",
                str(config), "--host", "127.0.0.1", cwd=str(ROOT), env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT)
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"http://127.0.0.1:{self.port}/healthz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"bot serve did not start: see {self.log_path}")

    async def send(self, stop: asyncio.Event) -> None:
        import hashlib
        import hmac

        import aiohttp

        number = 900_000
        sent: dict[int, float] = {}
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                number += 1
                body = json.dumps({
                    "action": "opened", "issue": {
                        "number": number, "title": self.text["title"], "body": self.text["body"],
                        "state": "open", "user": {"login": "reporter", "type": "User"},
                        "labels": [], "created_at": "2026-01-01T00:00:00Z"},
                    "repository": {"full_name": self.repo, "private": False},
                    "installation": {"id": 1},
                    "sender": {"login": "reporter", "type": "User"}}).encode()
                signature = "sha256=" + hmac.new(self.secret.encode(), body,
                                                 hashlib.sha256).hexdigest()
                sent[number] = time.monotonic()
                async with session.post(
                        f"http://127.0.0.1:{self.port}/webhook", data=body,
                        headers={"X-GitHub-Event": "issues", "X-GitHub-Delivery": str(number),
                                 "X-Hub-Signature-256": signature,
                                 "Content-Type": "application/json"}) as r:
                    await r.read()
                with_timeout = asyncio.ensure_future(stop.wait())
                await asyncio.wait([with_timeout], timeout=1.0)
                with_timeout.cancel()
        await asyncio.sleep(3.0)  # the last deliveries' comments
        for n, t in sent.items():
            got = self.fake.arrivals.get((self.repo.lower(), n))
            if got is None:
                self.unanswered += 1
            else:
                self.latencies.append(got - t)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    private_pem, public_pem = key_pair()
    latency = args.latency_ms / 1000
    with tempfile.TemporaryDirectory(prefix="dejafix-backfill-") as tmp:
        work = Path(tmp)
        load = os.getloadavg()
        print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
              f"{load[2]:.2f} (1, 5, 15 min){'; BUSY' if load[0] > (os.cpu_count() or 1) else ''}",
              flush=True)
        fast = await Fake(public_pem, latency, args).start()
        history = fast.history
        print(f"history: {history.prs} PRs listed, {history.merged} merged, "
              f"{history.closing_prs} closing {history.closings} issues, {history.big_prs} PRs "
              f"with more than 100 files (largest {history.max_files}), {history.duplicates} "
              f"closed as duplicates; GitHub answering at {args.latency_ms:.0f} ms a call",
              flush=True)
        live: Live | None = None
        sender: asyncio.Task[None] | None = None
        stop = asyncio.Event()
        try:
            if not args.no_live:
                live = Live(fast, private_pem, work)
                await live.start(work / "graphql")
                sender = asyncio.create_task(live.send(stop))
            first = await backfill(fast, private_pem, work / "graphql")
        finally:
            stop.set()
            if sender is not None:
                await sender
            if live is not None:
                await live.stop()
            await fast.stop()
        print(f"GraphQL, paths first, to every cluster learned (pulls and duplicates phases): "
              f"{first.learned_calls} calls, {first.learned_seconds / 60:.2f} min, "
              f"{len(first.learned_clusters)} clusters", flush=True)
        print(f"GraphQL, paths first, to the diffs in (the diffs phase, over REST): "
              f"{first.calls} calls, {first.seconds / 60:.2f} min, {len(first.clusters)} "
              f"clusters", flush=True)

        rest_fake = await Fake(public_pem, 0.0, args).start()
        try:
            rest_run = await backfill(rest_fake, private_pem, work / "rest", graphql=False)
        finally:
            await rest_fake.stop()
        rest, r_calls = rest_run.clusters, rest_run.calls
        r_minutes = r_calls * latency / 60
        print(f"REST (run at 0 ms; minutes = calls x {args.latency_ms:.0f} ms, as it calls one "
              f"at a time): {r_calls} calls, {r_minutes:.1f} min, {len(rest)} clusters",
              flush=True)

    equal_diffs = first.clusters == rest
    equal_paths = first.learned_clusters == without_hunks(rest)
    print(f"clusters equal to REST: at the end {equal_diffs}; when every cluster was learned, "
          f"diff hunks aside {equal_paths}")
    p99 = _p99(live.latencies) if live is not None else None
    if live is not None:
        print(f"live issue->comment while the backfill ran: {len(live.latencies)} answered, "
              f"{live.unanswered} unanswered, p99 {p99 if p99 is None else round(p99, 3)} s")
    calls, seconds = first.learned_calls, first.learned_seconds
    merged = history.merged
    result = {
        "prs": merged, "calls": calls, "calls_per_100_prs": round(100 * calls / merged, 2),
        "minutes": round(seconds / 60, 2), "clusters": len(first.learned_clusters),
        "clusters_rest": len(rest),
        "live_p99_s": None if p99 is None else round(p99, 3),
        "clusters_equal_diff_hunks_aside": equal_paths,
        "calls_with_diffs": first.calls, "minutes_with_diffs": round(first.seconds / 60, 2),
        "clusters_with_diffs_equal": equal_diffs,
        "calls_rest": r_calls, "minutes_rest_estimated": round(r_minutes, 1),
        "live_answered": len(live.latencies) if live else 0,
        "live_unanswered": live.unanswered if live else 0,
        "load_average_1m": round(load[0], 2),
    }
    targets = [("calls <= 400", calls <= 400), ("minutes <= 5", seconds / 60 <= 5),
               ("clusters == clusters_rest", len(first.learned_clusters) == len(rest)),
               ("record by record equal to REST after the diffs", equal_diffs),
               ("live p99 <= 1.5 s", p99 is not None and p99 <= 1.5)]
    print("targets: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in targets))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prs", type=int, default=10_000)
    parser.add_argument("--closing-prs", type=int, default=3_000)
    parser.add_argument("--issues", type=int, default=4_000)
    parser.add_argument("--duplicates", type=int, default=500)
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-live", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
