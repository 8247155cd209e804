"""What ``python -m bot eval`` adds to its cross-validated figures, so that they are read for
what they are worth: a bootstrap interval (pooled over several repositories by resampling within
each), the false-alarm rate, the figures by kind of issue, and the wrong comments with the
evidence that made them.

Pure functions of outcomes (``bot.eval.fit.Outcome``: ``expected``, ``top``, ``score``,
``second``, ``regression``), labelled queries and clusters; ``bot/eval/offline.py`` prints them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bot.clusters.models import Cluster
from bot.eval.fit import Outcome

# --- when the bot speaks --------------------------------------------------------------------


def speaks(o: Outcome, threshold: float, margin: float) -> bool:
    """Whether the bot would comment: a top match at ``score >= threshold`` with a lead of at
    least ``margin`` over the runner-up, and not a possible regression of its fix (under the
    default ``regressions: label`` those are labelled, not answered "already fixed")."""
    return (o.top is not None and o.score >= threshold and o.score - o.second >= margin
            and not o.regression)


def labels(o: Outcome, threshold: float, margin: float) -> bool:
    """Whether the bot would label the issue a possible regression of its top match's fix (the
    default ``regressions: label``): a visible action, wrong when that cluster is not the
    issue's."""
    return (o.top is not None and o.score >= threshold and o.score - o.second >= margin
            and o.regression)


def wrong_labels(outcomes: Iterable[Outcome], threshold: float, margin: float
                 ) -> tuple[int, int]:
    """(wrong, all) possible-regression labels the bot would put on these issues."""
    put = [o for o in outcomes if labels(o, threshold, margin)]
    return sum(1 for o in put if o.top != o.expected), len(put)


def is_right(o: Outcome) -> bool:
    return o.expected is not None and o.top == o.expected


def is_false_alarm(o: Outcome, threshold: float, margin: float) -> bool:
    """A comment on an issue labelled as having no cluster (unrelated or a hard negative): the
    by-kind table's "false alarms", and the numerator of the false-alarm rate, whose denominator
    is the issues with no cluster."""
    return o.expected is None and speaks(o, threshold, margin)


# --- bootstrap ------------------------------------------------------------------------------

RESAMPLES = 2000
LEVEL = 0.90
SEED = 20240601
# Resamples drawn at once: bounds the index array at about this many entries times 8 bytes.
_CHUNK_CELLS = 2_000_000


@dataclass(frozen=True)
class BootstrapPR:
    """Precision and recall of the comments with percentile bootstrap intervals.

    ``precision`` is None when nothing was said (no comment to be right or wrong about);
    ``recall`` is None when no issue has a cluster. A resample with no comment has no precision
    and one with no positive has no recall: such resamples are left out of that interval and
    counted in ``skipped_precision`` / ``skipped_recall``. An interval is None when every
    resample was left out.

    ``false_alarm_rate``: comments on issues with no cluster (``is_false_alarm``) over those
    issues (``negatives``), None when there is none; its interval skips resamples without a
    negative in the same way. ``groups``: the sets (repositories) resampled each within itself.
    The fields after ``skipped_recall`` came later and have defaults so that older callers
    still build one."""

    issues: int
    resamples: int
    level: float
    seed: int
    comments: int
    right: int
    positives: int
    precision: float | None
    recall: float | None
    precision_ci: tuple[float, float] | None
    recall_ci: tuple[float, float] | None
    skipped_precision: int
    skipped_recall: int
    groups: int = 1
    negatives: int = 0
    false_alarms: int = 0
    false_alarm_rate: float | None = None
    false_alarm_ci: tuple[float, float] | None = None
    skipped_false_alarm: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("precision_ci", "recall_ci", "false_alarm_ci"):
            out[key] = list(out[key]) if out[key] is not None else None
        return out


def bootstrap_pr(outcomes: Sequence[Outcome], threshold: float, margin: float, *,
                 resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
                 ) -> BootstrapPR:
    """Percentile bootstrap of comment precision, recall and false-alarm rate at
    ``threshold``/``margin``: ``resamples`` resamples of the issues, each as many as there are,
    drawn with replacement (numpy, seeded: the same outcomes give the same interval)."""
    return bootstrap_pooled([outcomes], threshold, margin, resamples=resamples, level=level,
                            seed=seed)


def _flags(outcomes: Sequence[Outcome], threshold: float, margin: float
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per issue: the bot speaks, speaks rightly, the issue has a cluster, a false alarm."""
    n = len(outcomes)

    def flag(values: Iterable[bool]) -> np.ndarray:
        return np.fromiter(values, dtype=np.int64, count=n)

    return (flag(speaks(o, threshold, margin) for o in outcomes),
            flag(speaks(o, threshold, margin) and is_right(o) for o in outcomes),
            flag(o.expected is not None for o in outcomes),
            flag(is_false_alarm(o, threshold, margin) for o in outcomes))


def bootstrap_pooled(groups: Sequence[Sequence[Outcome]], threshold: float, margin: float, *,
                     resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
                     ) -> BootstrapPR:
    """``bootstrap_pr`` over several repositories' outcomes together: each resample draws every
    repository's issues from that repository only, as many as it has, so that each keeps its
    weight and its share of positives (a pooled draw would let the small set's few positives
    vanish from some resamples and swamp others). One group draws exactly as ``bootstrap_pr``
    always has: the same seed gives the same interval as before pooling existed."""
    flags = [_flags(g, threshold, margin) for g in groups]
    n = sum(len(g) for g in groups)
    comments = sum(int(f[0].sum()) for f in flags)
    hits = sum(int(f[1].sum()) for f in flags)
    positives = sum(int(f[2].sum()) for f in flags)
    alarms = sum(int(f[3].sum()) for f in flags)
    negatives = n - positives
    precision = hits / comments if comments else None
    recall = hits / positives if positives else None
    alarm_rate = alarms / negatives if negatives else None
    if n == 0 or resamples <= 0:
        skipped = max(0, resamples)
        return BootstrapPR(n, skipped, level, seed, comments, hits, positives, precision, recall,
                           None, None, skipped, skipped, groups=len(groups), negatives=negatives,
                           false_alarms=alarms, false_alarm_rate=alarm_rate,
                           skipped_false_alarm=skipped)
    rng = np.random.default_rng(seed)
    b_said = np.zeros(resamples, dtype=np.int64)
    b_right = np.zeros(resamples, dtype=np.int64)
    b_pos = np.zeros(resamples, dtype=np.int64)
    b_alarm = np.zeros(resamples, dtype=np.int64)
    step = max(1, _CHUNK_CELLS // n)
    for start in range(0, resamples, step):
        m = min(step, resamples - start)
        for said, right, pos, alarm in flags:
            size = len(said)
            if not size:
                continue
            idx = rng.integers(0, size, size=(m, size))
            b_said[start:start + m] += said[idx].sum(axis=1)
            b_right[start:start + m] += right[idx].sum(axis=1)
            b_pos[start:start + m] += pos[idx].sum(axis=1)
            b_alarm[start:start + m] += alarm[idx].sum(axis=1)
    tails = [100 * (1 - level) / 2, 100 * (1 + level) / 2]

    def interval(num: np.ndarray, den: np.ndarray) -> tuple[tuple[float, float] | None, int]:
        ok = den > 0
        skipped = int((~ok).sum())
        if not ok.any():
            return None, skipped
        lo, hi = np.percentile(num[ok] / den[ok], tails)
        return (float(lo), float(hi)), skipped

    p_ci, p_skip = interval(b_right, b_said)
    r_ci, r_skip = interval(b_right, b_pos)
    # Every resample holds n issues: those without a cluster are the rest.
    a_ci, a_skip = interval(b_alarm, n - b_pos)
    return BootstrapPR(n, resamples, level, seed, comments, hits, positives, precision, recall,
                       p_ci, r_ci, p_skip, r_skip, groups=len(groups), negatives=negatives,
                       false_alarms=alarms, false_alarm_rate=alarm_rate, false_alarm_ci=a_ci,
                       skipped_false_alarm=a_skip)


def format_bootstrap(b: BootstrapPR, threshold: float, margin: float,
                     label: str = "cross-validated") -> str:
    """One line: ``cross-validated @ threshold T margin M: precision P [90% CI lo-hi] recall R
    [lo-hi] (bootstrap over N issues, B resamples)``; pooled over several repositories, it says
    that the issues were resampled within each."""

    def fig(point: float | None, ci: tuple[float, float] | None, label: str) -> str:
        if point is None:
            return "n/a"
        inner = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "n/a"
        return f"{point:.3f} [{label}{inner}]"

    pct = f"{b.level * 100:g}% CI "
    within = f" resampled within each of {b.groups} repositories" if b.groups > 1 else ""
    line = (f"{label} @ threshold {threshold:.2f} margin {margin:.2f}:"
            f" precision {fig(b.precision, b.precision_ci, pct)}"
            f" recall {fig(b.recall, b.recall_ci, '')}"
            f" (bootstrap over {b.issues} issues{within}, {b.resamples} resamples")
    notes = []
    if b.skipped_precision:
        notes.append(f"{b.skipped_precision} without a comment skipped for precision")
    if b.skipped_recall:
        notes.append(f"{b.skipped_recall} without a positive skipped for recall")
    return line + ("; " + "; ".join(notes) if notes else "") + ")"


def upper_bound_none_seen(n: int, level: float = LEVEL) -> float | None:
    """The exact (Clopper-Pearson) upper end of the ``level`` interval of a rate seen 0 times in
    ``n``. With no false alarm there is nothing to resample and the bootstrap interval is 0-0,
    which reads as certainty: 0 of 58 still allows about 5%."""
    return 1 - ((1 - level) / 2) ** (1 / n) if n > 0 else None


def format_false_alarms(b: BootstrapPR) -> str:
    """``k of n (x%) [90% CI lo-hi%]``: comments on the n issues with no cluster."""
    if b.false_alarm_rate is None:
        return f"{b.false_alarms} of 0 (no issue without a cluster)"
    ci = b.false_alarm_ci
    inner = f"{100 * ci[0]:.1f}-{100 * ci[1]:.1f}%" if ci else "n/a"
    upper = upper_bound_none_seen(b.negatives, b.level) if b.false_alarms == 0 else None
    if upper is not None:
        inner += f"; none to resample, exact upper bound {100 * upper:.1f}%"
    return (f"{b.false_alarms} of {b.negatives} ({100 * b.false_alarm_rate:.1f}%)"
            f" [{b.level * 100:g}% CI {inner}]")


def false_alarm_dict(b: BootstrapPR) -> dict[str, Any]:
    """The false-alarm figures of ``b`` for ``--json-report``; ``exact_upper`` only when there
    is no false alarm (see ``upper_bound_none_seen``)."""
    return {"false_alarms": b.false_alarms, "negatives": b.negatives, "rate": b.false_alarm_rate,
            "ci": list(b.false_alarm_ci) if b.false_alarm_ci else None, "level": b.level,
            "resamples": b.resamples, "skipped": b.skipped_false_alarm,
            "exact_upper": upper_bound_none_seen(b.negatives, b.level)
            if b.false_alarms == 0 else None}


# --- kinds of issue -------------------------------------------------------------------------

# Scripts that say "not written in English" (code points, inclusive). Latin letters with
# accents are not here, nor Greek: a stray "μs" or "Δ" in an English report is not a language.
OTHER_SCRIPTS: tuple[tuple[str, int, int], ...] = (
    ("Cyrillic", 0x0400, 0x052F),
    ("Hebrew", 0x0590, 0x05FF),
    ("Arabic", 0x0600, 0x06FF),
    ("Devanagari", 0x0900, 0x097F),
    ("Thai", 0x0E00, 0x0E7F),
    ("Hangul", 0x1100, 0x11FF),
    ("Kana", 0x3040, 0x30FF),
    ("Hangul", 0x3130, 0x318F),
    ("Han", 0x3400, 0x4DBF),
    ("Han", 0x4E00, 0x9FFF),
    ("Hangul", 0xAC00, 0xD7AF),
    ("Han", 0xF900, 0xFAFF),
    ("Han", 0x20000, 0x2FA1F),
)
# This many characters of those scripts make an issue "other language": one alone may be a
# look-alike letter (a Cyrillic "а" in an English word) or a pasted symbol.
MIN_SCRIPT_CHARS = 2


def scripts_in(text: str) -> dict[str, int]:
    """Characters of each script in ``OTHER_SCRIPTS`` that ``text`` holds."""
    found: dict[str, int] = {}
    for ch in text:
        cp = ord(ch)
        if cp < 0x0400:
            continue
        for name, lo, hi in OTHER_SCRIPTS:
            if lo <= cp <= hi:
                found[name] = found.get(name, 0) + 1
                break
    return found


def other_language(title: str, body: str) -> bool:
    """The title and body hold at least ``MIN_SCRIPT_CHARS`` characters of a non-Latin script
    (Han, Kana, Hangul, Cyrillic, Arabic, Hebrew, Devanagari, Thai): written in another language,
    or mixing one in."""
    return sum(scripts_in(f"{title}\n{body}").values()) >= MIN_SCRIPT_CHARS


def is_release_note_cluster(cluster: Cluster) -> bool:
    """A cluster known from a release-note line, not from reports: its fix shipped in a named
    release (``landed_fix.released_in``) and no issue among its members has a title — the
    matcher has the line (label, fix PR number) and at most some PR's title, nothing a
    reporter wrote. A cluster from issue threads whose fix later shipped still has its reports'
    titles, and is not one. (A PR member's title does not disqualify a cluster: a release-note
    entry sometimes lists a competing PR beside the one that landed.)"""
    if not cluster.landed_fix.released_in:
        return False
    return not any(m.title and not m.is_pr for m in cluster.members)


KINDS = ("all", "positives", "negatives", "hard negatives", "PR-shaped", "other language",
         "empty body", "release-note clusters")


def kinds_of(query: dict[str, Any], release_note_ids: frozenset[str] | set[str]) -> list[str]:
    """The rows of the by-kind table a labelled issue counts in (several at once), in
    ``KINDS`` order. ``release_note_ids``: the public ids of release-note clusters."""
    expected = str(query["expected"]) if query.get("expected") else None
    title = str(query.get("title") or "")
    body = str(query.get("body") or "")
    out = ["all", "positives" if expected else "negatives"]
    if query.get("hard_negative") is True:
        out.append("hard negatives")
    if query.get("kind") == "pr":
        out.append("PR-shaped")
    if other_language(title, body):
        out.append("other language")
    if not body.strip():
        out.append("empty body")
    if expected and expected in release_note_ids:
        out.append("release-note clusters")
    return out


@dataclass(frozen=True)
class KindRow:
    """One kind's cross-validated outcomes. ``wrong`` = comments that do not name the issue's
    cluster (on a positive, another cluster; on a negative, any: a false alarm).
    ``false_alarms`` = comments on negatives; its rate is over the negatives."""

    kind: str
    issues: int
    positives: int
    negatives: int
    comments: int
    right: int
    wrong: int
    false_alarms: int
    precision: float | None
    recall: float | None
    false_alarm_rate: float | None


def by_kind(outcomes: Sequence[Outcome], queries: Sequence[dict[str, Any]],
            clusters: Iterable[Cluster], threshold: float, margin: float) -> list[KindRow]:
    """The by-kind table; ``outcomes[i]`` is ``queries[i]``'s. Kinds no issue has are left
    out."""
    if len(outcomes) != len(queries):
        raise ValueError(f"{len(outcomes)} outcomes for {len(queries)} queries")
    notes = frozenset(c.public_id for c in clusters if is_release_note_cluster(c))
    members: dict[str, list[Outcome]] = {k: [] for k in KINDS}
    for o, q in zip(outcomes, queries, strict=True):
        for k in kinds_of(q, notes):
            members[k].append(o)
    rows = []
    for kind in KINDS:
        group = members[kind]
        if not group:
            continue
        said = [o for o in group if speaks(o, threshold, margin)]
        right = sum(is_right(o) for o in said)
        positives = sum(o.expected is not None for o in group)
        negatives = len(group) - positives
        alarms = sum(is_false_alarm(o, threshold, margin) for o in group)
        rows.append(KindRow(
            kind=kind, issues=len(group), positives=positives, negatives=negatives,
            comments=len(said), right=right, wrong=len(said) - right, false_alarms=alarms,
            precision=right / len(said) if said else None,
            recall=right / positives if positives else None,
            false_alarm_rate=alarms / negatives if negatives else None,
        ))
    return rows


def pool_kind_rows(tables: Sequence[Sequence[KindRow]]) -> list[KindRow]:
    """Several repositories' by-kind tables as one: counts added kind by kind, rates recomputed
    from the sums (not averaged: a repository weighs by its issues)."""
    rows = []
    for kind in KINDS:
        same = [r for table in tables for r in table if r.kind == kind]
        if not same:
            continue
        issues, positives, negatives, comments, right, wrong, alarms = (
            sum(getattr(r, f) for r in same)
            for f in ("issues", "positives", "negatives", "comments", "right", "wrong",
                      "false_alarms"))
        rows.append(KindRow(
            kind=kind, issues=issues, positives=positives, negatives=negatives,
            comments=comments, right=right, wrong=wrong, false_alarms=alarms,
            precision=right / comments if comments else None,
            recall=right / positives if positives else None,
            false_alarm_rate=alarms / negatives if negatives else None,
        ))
    return rows


def format_kind_table(rows: Sequence[KindRow]) -> list[str]:
    """Precision where something was said, recall where there are positives, false alarms
    (comments on issues with no cluster) and their rate where there are negatives; "-"
    elsewhere."""

    def num(v: float | None) -> str:
        return f"{v:9.3f}" if v is not None else f"{'-':>9}"

    lines = [f"{'kind':<22}{'issues':>6}{'pos':>5}{'neg':>5}{'comments':>9}{'right':>6}"
             f"{'wrong':>6}{'precision':>10}{'recall':>9}  false alarms"]
    for r in rows:
        alarms = f"{r.false_alarms}/{r.negatives} ({r.false_alarm_rate:.3f})" \
            if r.false_alarm_rate is not None else "-"
        lines.append(f"{r.kind:<22}{r.issues:6d}{r.positives:5d}{r.negatives:5d}"
                     f"{r.comments:9d}{r.right:6d}{r.wrong:6d} {num(r.precision)}"
                     f"{num(r.recall)}  {alarms}")
    return lines


# --- wrong comments -------------------------------------------------------------------------


def wrong_comments(outcomes: Sequence[Outcome], threshold: float, margin: float) -> list[int]:
    """Indices of the outcomes the bot would comment on with the wrong cluster (or on an issue
    that has none)."""
    return [i for i, o in enumerate(outcomes) if speaks(o, threshold, margin) and not is_right(o)]


def _item(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_item(x)}" for k, x in v.items())
    if isinstance(v, list | tuple | set):
        return ", ".join(_item(x) for x in v)
    return str(v)


def evidence_lines(evidence: dict[str, Any]) -> list[str]:
    """A match's evidence (``MatchEvidence.model_dump()``) for a person: ``parts`` split into
    the signals for (positive) and against (negative), then every other field that is not
    empty (lists, dicts, non-zero numbers, true flags, text), by its own name — a field added to
    the evidence shows up here without a change."""
    parts = evidence.get("parts") or {}
    pro = sorted(((k, v) for k, v in parts.items() if v > 0), key=lambda kv: -kv[1])
    con = sorted(((k, v) for k, v in parts.items() if v < 0), key=lambda kv: kv[1])
    lines = ["for: " + (", ".join(f"{k} {v:+.2f}" for k, v in pro) or "-"),
             "against: " + (", ".join(f"{k} {v:+.2f}" for k, v in con) or "-")]
    for key, value in evidence.items():
        if key == "parts" or value is None or value is False or value == 0 \
                or (hasattr(value, "__len__") and len(value) == 0):
            continue
        lines.append(f"{key}: {_item(value)}")
    return lines
