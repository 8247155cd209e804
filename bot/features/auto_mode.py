"""``mode: auto``: a repository measures itself before it speaks. It stays in shadow until its
backfill is done and its own backtest (``bot/eval/backtest.py``: each issue its maintainers
closed as a duplicate of a bug whose fix had landed is a question the bot should have answered)
reaches the deployment's ``auto_precision`` over at least ``auto_min_cases`` comments it would
have made; then it comments. The backtest runs once, when the backfill ends, and its figures are
kept in the store (``auto-verdict:<repo>``), where every process and the web page read them."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from bot.db.store import Store
from bot.eval.backtest import measure
from bot.matching import MatchPolicy
from bot.settings import ServiceConfig

PREFIX = "auto-verdict:"


@dataclass(frozen=True)
class Verdict:
    """The repository's backtest when its backfill ended."""

    precision: float
    # Comments the backtest would have made, and the right ones among them.
    cases: int
    right: int
    # Issues that were duplicates of a fixed bug (what it should have answered).
    positives: int
    threshold: float
    clusters: int
    at: float


def verdict_name(repo: str) -> str:
    return PREFIX + repo.lower()


def load_verdict(store: Store, repo: str) -> Verdict | None:
    raw = store.get_cursor(verdict_name(repo))
    if not raw:
        return None
    try:
        return Verdict(**json.loads(raw))
    except (ValueError, TypeError):
        return None


def compute_verdict(store: Store, repo: str, policy: MatchPolicy) -> Verdict:
    """Replay the repository's learned history at ``policy`` and keep the figures. CPU work
    and store reads: call it in a thread."""
    clusters = store.learned_clusters(repo)
    figures = measure(clusters, policy)
    verdict = Verdict(precision=round(figures.precision, 4), cases=figures.said,
                      right=figures.right, positives=figures.positives,
                      threshold=policy.threshold, clusters=figures.clusters, at=time.time())
    store.set_cursor(verdict_name(repo), json.dumps(asdict(verdict)))
    return verdict


@dataclass(frozen=True)
class AutoState:
    """Whether a ``mode: auto`` repository comments now, and why, in words for the page."""

    commenting: bool
    why: str


def decide(verdict: Verdict | None, config: ServiceConfig, *,
           backfill_off: bool = False) -> AutoState:
    want, least = config.auto_precision, config.auto_min_cases
    if verdict is None:
        if backfill_off:
            return AutoState(False, "auto: in shadow: its backfill is off, so its history is "
                                    "never measured (set mode: comment to speak)")
        return AutoState(False, "auto: in shadow until its backfill is done and its own "
                                f"backtest shows precision >= {want:g}")
    said = f"backtest precision {verdict.precision:.2f} on {verdict.cases} cases"
    if verdict.cases < least:
        return AutoState(False, f"auto: in shadow: not enough history ({said}; "
                                f"auto_min_cases is {least})")
    if verdict.precision < want:
        return AutoState(False, f"auto: in shadow: {said}, below auto_precision {want:g}")
    return AutoState(True, f"auto: commenting since {said} (auto_precision {want:g})")


def auto_state(store: Store, repo: str, config: ServiceConfig) -> AutoState:
    """A store read: call it in a thread."""
    return decide(load_verdict(store, repo), config)
