"""The offline commands: ``match`` (issues in, the bot's decisions out, one JSON line each) and
``eval`` (the matcher's figures on labelled issues, next to the two peer baselines; over several
repositories, each on its own and pooled).

``match`` output contract, one line per input issue, in input order::

    {"number": N, "comment": bool, "best": public_id | null, "score": float,
     "matches": [{"cluster": public_id, "score": float, "why": {...evidence...}}, ...]}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from bot.clusters.load import load_clusters
from bot.clusters.models import Cluster
from bot.eval import report as eval_report
from bot.eval.fit import Outcome
from bot.matching import IssueText, Matcher, MatchPolicy, ScoreModel, decide
from bot.matching.regression import Regression, regression_of
from bot.matching.types import Match


class _InOrder(argparse.Action):
    """``append``, and also note ``(dest, value)`` in ``given``: ``eval`` pairs each ``--queries``
    with the ``--clusters`` given before it, an order two plain ``append`` lists lose."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        # Copies, not in-place appends: argparse may share a default list between parses.
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])
        given = getattr(namespace, "given", None) or []
        namespace.given = [*given, (self.dest, values)]


def _add_common(parser: argparse.ArgumentParser,
                clusters_help: str = "Cluster file (.json, .jsonl, .md) or directory; may be"
                                     " repeated.") -> None:
    parser.add_argument(
        "--clusters",
        action=_InOrder,
        required=True,
        metavar="PATH",
        help=clusters_help,
    )
    parser.add_argument(
        "--model",
        metavar="FILE",
        help="Scoring coefficients (JSON, as written by bench/fit.py); default: built in.",
    )
    parser.add_argument("--threshold", type=float, help="Override the policy's threshold.")
    parser.add_argument("--margin", type=float, help="Override the policy's margin.")
    parser.add_argument("--limit", type=int, default=5, help="Candidates listed per issue.")


def add_match_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument(
        "--queries",
        metavar="FILE",
        help='Issues as JSON Lines {"number", "title", "body"}; default: standard input.',
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="Print, for a person, the decision and each candidate's evidence for and against"
        " (instead of JSON Lines).",
    )


EVAL_EPILOG = """\
several repositories: give each one's --clusters, then its --queries:
  --clusters A.jsonl --queries qa.jsonl --clusters B.jsonl --clusters B2/ --queries qb.jsonl
Each --queries file is matched only against the --clusters given since the previous
--queries (several for one repository are fine); with a single --queries, every --clusters
is its, wherever it stands, as before. Each repository is indexed, scored and
cross-validated on its own and printed under a heading naming it (its clusters' "repo"),
with its false-alarm rate (comments on issues labelled with no cluster); then the pooled
figures: counts summed over the repositories, bootstrap intervals resampling issues within
each. --json-report then writes {"repositories": [one report each], "pooled": {...}}."""


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser, clusters_help="Cluster file (.json, .jsonl, .md) or directory; may be"
                " repeated: all those before a --queries are one repository's (see below).")
    parser.add_argument(
        "--queries", required=True, action=_InOrder, metavar="FILE",
        help="Labelled issues (JSON Lines); repeat, each after its repository's --clusters, to"
        " evaluate several repositories.",
    )
    # The epilog's example lines are laid out by hand.
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EVAL_EPILOG
    parser.add_argument("--plot", metavar="PNG", help="Write the precision-recall plot here.")
    parser.add_argument(
        "--no-baselines", action="store_true", help="Skip the peer baselines (they are slow)."
    )
    parser.add_argument(
        "--cv",
        type=int,
        default=10,
        metavar="K",
        help="Folds for the cross-validated figures (refits the model per fold); 0 = skip.",
    )
    parser.add_argument(
        "--json-report",
        metavar="FILE",
        help="Also write every figure (in-sample, cross-validated with its bootstrap interval,"
        " by kind, the wrong comments and their evidence, the baselines) as one JSON object.",
    )


def _policy(args: argparse.Namespace) -> MatchPolicy:
    policy = MatchPolicy()
    update: dict[str, float] = {}
    if args.threshold is not None:
        update["threshold"] = args.threshold
    if args.margin is not None:
        update["margin"] = args.margin
    return policy.model_copy(update=update) if update else policy


def _check_clusters(paths: Sequence[str]) -> None:
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        # An empty index would answer "no match" to everything: say what is wrong instead.
        for path in missing:
            print(f"--clusters {path}: no such file or directory", file=sys.stderr)
        raise SystemExit(2)


def _load_clusters(paths: Sequence[str]) -> list[Cluster]:
    _check_clusters(paths)
    report = load_clusters(list(paths))
    for error in report.errors:
        print(f"clusters: {error}", file=sys.stderr)
    return report.clusters


def _load(args: argparse.Namespace) -> tuple[list[Cluster], ScoreModel | None]:
    return _load_clusters(args.clusters), _load_model(args)


def _load_model(args: argparse.Namespace) -> ScoreModel | None:
    try:
        model = ScoreModel.load(Path(args.model)) if args.model else None
    except (OSError, ValueError) as exc:
        print(f"--model {args.model}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return model


def _read_jsonl(stream: IO[str], source: str) -> Iterator[dict[str, Any]]:
    for n, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            print(f"{source}:{n}: not JSON: {exc}", file=sys.stderr)
            continue
        if not isinstance(record, dict):
            print(f"{source}:{n}: expected an object", file=sys.stderr)
            continue
        yield record


def _issue(record: dict[str, Any]) -> IssueText:
    return IssueText(
        number=record.get("number"),
        title=str(record.get("title") or ""),
        body=str(record.get("body") or ""),
    )


def match_record(matches: list[Match], number: Any, policy: MatchPolicy,
                 issue: IssueText | None = None) -> dict[str, Any]:
    """One issue's line. With ``issue``, a best match that is a possible regression of its
    fix (bot/matching/regression.py) gets no comment, as the bot's default
    ``regressions: label`` posts none; ``regression`` says why."""
    chosen = decide(matches, policy)
    regression = regression_of(issue, chosen.cluster) if chosen and issue else None
    return {
        "number": number,
        "comment": chosen is not None and regression is None,
        "best": chosen.public_id if chosen else None,
        "score": matches[0].score if matches else 0.0,
        "regression": regression.model_dump() if regression else None,
        "matches": [
            {"cluster": m.public_id, "score": m.score, "why": m.evidence.model_dump()}
            for m in matches
        ],
    }


def explain(record: dict[str, Any], issue: IssueText, matches: list[Match]) -> str:
    """``match --explain``: what the bot would do with one issue, and the evidence for and
    against each candidate, for a person to read."""
    if record["comment"]:
        verdict = f"comment: cluster {record['best']}"
    elif record.get("regression"):
        verdict = (f"possible regression of cluster {record['best']} (labelled, no comment):"
                   f" {Regression.model_validate(record['regression']).reason()}")
    else:
        verdict = "silent"
    lines = [f"#{issue.number} {issue.title[:100]}", f"  -> {verdict}"]
    for m in matches:
        lines.append(f"  {m.score:.3f}  {m.public_id}  {m.cluster.display_label[:90]}")
        lines += [f"      {line}" for line in eval_report.evidence_lines(m.evidence.model_dump())]
    return "\n".join(lines) + "\n"


def run_match(args: argparse.Namespace) -> int:
    clusters, model = _load(args)
    matcher = Matcher(clusters, model=model)
    policy = _policy(args)
    if args.queries:
        stream: IO[str] = open(args.queries, encoding="utf-8")  # noqa: SIM115
    else:
        stream = sys.stdin
    try:
        for record in _read_jsonl(stream, args.queries or "<stdin>"):
            issue = _issue(record)
            matches = matcher.rank(issue, limit=args.limit, policy=policy)
            out = match_record(matches, record.get("number"), policy, issue)
            text = explain(out, issue, matches) if args.explain \
                else json.dumps(out, ensure_ascii=False) + "\n"
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except BrokenPipeError:
                # The reader stopped (``| head``): nothing more to say, and no traceback.
                return 0
    finally:
        if stream is not sys.stdin:
            stream.close()
    return 0


# --- evaluation --------------------------------------------------------------------------------


_THRESHOLDS = (0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def load_labelled(path: str) -> list[dict[str, Any]]:
    """Labelled queries as score.py counts them: uncertain labels left out."""
    with open(path, encoding="utf-8") as fh:
        return [q for q in _read_jsonl(fh, path) if not q.get("uncertain")]


def _expected(q: dict[str, Any]) -> str | None:
    return str(q["expected"]) if q.get("expected") else None


def pr_at(
    outcomes: Sequence[Outcome], threshold: float, margin: float = 0.0
) -> tuple[int, int, float, float]:
    """(comments, right, precision, recall) when speaking at ``score >= threshold`` and a lead
    of at least ``margin`` over the runner-up — counted exactly as score.py counts."""
    positives = sum(1 for o in outcomes if o.expected)
    said = right = 0
    for o in outcomes:
        # A possible regression is labelled, not answered "already fixed" (regressions: label).
        if eval_report.speaks(o, threshold, margin):
            said += 1
            right += int(eval_report.is_right(o))
    precision = right / said if said else 1.0
    recall = right / positives if positives else 0.0
    return said, right, precision, recall


def pr_curve(outcomes: Sequence[Outcome]) -> list[tuple[float, float, float]]:
    """(threshold, precision, recall) at every distinct score, highest threshold first."""
    out = []
    for th in sorted({o.score for o in outcomes if o.top is not None}, reverse=True):
        _, _, p, r = pr_at(outcomes, th)
        out.append((th, p, r))
    return out


def best_threshold(
    outcomes: Sequence[Outcome], min_precision: float = 0.9
) -> tuple[float, float, float]:
    """A baseline's best single threshold: the highest recall at precision >= ``min_precision``;
    when no threshold reaches it, the best F1."""
    curve = pr_curve(outcomes)
    ok = [c for c in curve if c[1] >= min_precision and c[2] > 0]
    if ok:
        return max(ok, key=lambda c: (c[2], c[1]))
    if not curve:
        return (1.0, 1.0, 0.0)
    return max(curve, key=lambda c: 2 * c[1] * c[2] / (c[1] + c[2]) if c[1] + c[2] else 0.0)


def matcher_outcomes(
    matcher: Matcher, queries: Iterable[dict[str, Any]], policy: MatchPolicy
) -> list[Outcome]:
    out = []
    for q in queries:
        issue = _issue(q)
        matches = matcher.rank(issue, limit=5, policy=policy)
        exp = _expected(q)
        out.append(
            Outcome(
                expected=exp,
                top=matches[0].public_id if matches else None,
                score=matches[0].score if matches else 0.0,
                second=matches[1].score if len(matches) > 1 else 0.0,
                in_top5=any(m.public_id == exp for m in matches),
                regression=bool(matches) and regression_of(issue, matches[0].cluster)
                is not None,
            )
        )
    return out


def baseline_outcomes(baseline: Any, queries: Iterable[dict[str, Any]]) -> list[Outcome]:
    out = []
    for q in queries:
        ranked = baseline.rank(str(q.get("title") or ""), str(q.get("body") or ""), limit=5)
        exp = _expected(q)
        out.append(
            Outcome(
                expected=exp,
                top=ranked[0][0] if ranked else None,
                score=ranked[0][1] if ranked else 0.0,
                second=ranked[1][1] if len(ranked) > 1 else 0.0,
                in_top5=any(cid == exp for cid, _ in ranked),
            )
        )
    return out


def _recall_at(outcomes: Sequence[Outcome]) -> tuple[float, float]:
    pos = [o for o in outcomes if o.expected]
    if not pos:
        return 0.0, 0.0
    return (
        sum(o.top == o.expected for o in pos) / len(pos),
        sum(o.in_top5 for o in pos) / len(pos),
    )


def write_plot(
    path: str, curves: dict[str, list[tuple[float, float, float]]], point: tuple[float, float]
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed, no plot written; install the eval extra: "
              ".venv/bin/pip install -e '.[eval]'", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, curve in curves.items():
        if curve:
            ax.plot([c[2] for c in curve], [c[1] for c in curve], marker=".", label=name)
    ax.scatter([point[1]], [point[0]], color="black", zorder=5, label="default threshold")
    ax.set_xlabel("recall")
    ax.set_ylabel("precision of comments")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_pr_table(outcomes: list[Outcome], margin: float, prefix: str = "") -> None:
    pad = " " * len(prefix)
    print(f"{prefix}threshold  comments  precision  recall")
    for th in _THRESHOLDS:
        said, _, precision, recall = pr_at(outcomes, th, margin)
        print(f"{pad}  {th:5.2f}    {said:6d}    {precision:7.3f}  {recall:7.3f}")


def _pr_rows(outcomes: Sequence[Outcome], margin: float) -> list[dict[str, float]]:
    rows = []
    for th in _THRESHOLDS:
        said, right, precision, recall = pr_at(outcomes, th, margin)
        rows.append({"threshold": th, "comments": said, "right": right,
                     "precision": precision, "recall": recall})
    return rows


def wrong_comment_report(
    matcher: Matcher, policy: MatchPolicy, queries: Sequence[dict[str, Any]],
    cv: Sequence[Outcome],
) -> list[dict[str, Any]]:
    """Each wrong cross-validated comment (``cv[i]`` is ``queries[i]``'s): the issue, the
    cluster it named and the one expected, the CV score, and the in-sample matcher's evidence
    for the named cluster. The in-sample top match is that cluster nearly always; when it is
    not (the fold's model ranked differently), the named cluster's own evidence is taken from
    the in-sample top 5 and ``in_sample_rank`` says where it stood (None: not in the top 5,
    and the evidence shown is the in-sample top's, ``evidence_of`` says whose)."""
    out = []
    for i in eval_report.wrong_comments(cv, policy.threshold, policy.margin):
        q, o = queries[i], cv[i]
        issue = _issue(q)
        matches = matcher.rank(issue, limit=5, policy=policy)
        rank = next((n for n, m in enumerate(matches, 1) if m.public_id == o.top), None)
        shown = matches[rank - 1] if rank else (matches[0] if matches else None)
        out.append({
            "number": q.get("number"),
            "title": issue.title[:100],
            "named": o.top,
            "expected": _expected(q),
            "cv_score": o.score,
            "cv_second": o.second,
            "in_sample_top": matches[0].public_id if matches else None,
            "in_sample_rank": rank,
            "evidence_of": shown.public_id if shown else None,
            "in_sample_score": shown.score if shown else None,
            "evidence": shown.evidence.model_dump() if shown else None,
        })
    return out


def print_wrong_comments(wrong: Sequence[dict[str, Any]]) -> None:
    print(f"cross-validated wrong comments: {len(wrong)}")
    for w in wrong:
        print(f"  #{w['number']} {w['title']}")
        print(f"    named {w['named']} (CV score {w['cv_score']:.3f}, runner-up"
              f" {w['cv_second']:.3f}); expected {w['expected'] or 'none'}")
        if w["evidence"] is None:
            print("    in-sample: no match")
            continue
        if w["in_sample_rank"] == 1:
            where = "in-sample top match"
        elif w["in_sample_rank"]:
            where = (f"in-sample rank {w['in_sample_rank']} (in-sample top:"
                     f" {w['in_sample_top']})")
        else:
            where = f"not in the in-sample top 5; shown: the in-sample top {w['evidence_of']}"
        print(f"    evidence, {where}, score {w['in_sample_score']:.3f}:")
        for line in eval_report.evidence_lines(w["evidence"]):
            print(f"      {line}")


@dataclass
class Repository:
    """One repository of ``eval``: its cluster files and its labelled issues."""

    clusters: list[str]
    queries: str


@dataclass
class RepoEval:
    """One repository's outcomes (``ours[i]`` and ``cv[i]`` are ``queries[i]``'s) and report."""

    name: str
    clusters: list[Cluster]
    queries: list[dict[str, Any]]
    ours: list[Outcome]
    cv: list[Outcome]
    kinds: list[eval_report.KindRow] | None
    in_sample_boot: eval_report.BootstrapPR
    cv_boot: eval_report.BootstrapPR | None
    baselines: dict[str, list[Outcome]]
    report: dict[str, Any]


def _usage_error(message: str) -> SystemExit:
    print(message, file=sys.stderr)
    return SystemExit(2)


def eval_repositories(args: argparse.Namespace) -> list[Repository]:
    """The repositories ``eval`` was given, in order. With one ``--queries`` every ``--clusters``
    is its (as before several could be given); with several, each ``--queries`` takes the
    ``--clusters`` given since the previous one."""
    queries: list[str] = args.queries
    if len(queries) == 1:
        return [Repository(list(args.clusters), queries[0])]
    out: list[Repository] = []
    pending: list[str] = []
    for dest, path in getattr(args, "given", None) or []:
        if dest == "clusters":
            pending.append(path)
        elif not pending:
            raise _usage_error(f"--queries {path}: no --clusters before it; give each"
                               " repository's --clusters, then its --queries")
        else:
            out.append(Repository(pending, path))
            pending = []
    if pending:
        raise _usage_error(f"--clusters {' '.join(pending)}: after the last --queries; give each"
                           " repository's --clusters, then its --queries")
    return out


def _repo_name(clusters: Sequence[Cluster], repo: Repository) -> str:
    names = sorted({c.repo for c in clusters})
    if not names:
        return repo.queries
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} and {len(names) - 1} more"


def _false_alarm_line(label: str, policy: MatchPolicy, in_sample: eval_report.BootstrapPR,
                      cv: eval_report.BootstrapPR | None) -> str:
    line = (f"{label} (comments on issues with no cluster) @ threshold {policy.threshold:.2f}"
            f" margin {policy.margin:.2f}: in-sample {eval_report.format_false_alarms(in_sample)}")
    if cv is not None:
        line += f"; cross-validated {eval_report.format_false_alarms(cv)}"
    return line


def _label_line(policy: MatchPolicy, ours: Sequence[Outcome], cv: Sequence[Outcome]) -> str:
    """The possible-regression labels the default policy would put instead of a comment: not
    counted in the comments above, but seen by everyone on the issue."""
    wrong, put = eval_report.wrong_labels(ours, policy.threshold, policy.margin)
    line = f"possible-regression labels (not comments): in-sample {put}, {wrong} on the wrong bug"
    if cv:
        cv_wrong, cv_put = eval_report.wrong_labels(cv, policy.threshold, policy.margin)
        line += f"; cross-validated {cv_put}, {cv_wrong} on the wrong bug"
    return line


def run_eval(args: argparse.Namespace) -> int:
    repos = eval_repositories(args)
    # Every path is checked before anything runs: a typo in the last repository should not
    # cost the time of evaluating the first ones.
    for repo in repos:
        _check_clusters(repo.clusters)
    for repo in repos:
        if not Path(repo.queries).is_file():
            raise _usage_error(f"--queries {repo.queries}: no such file")
    loaded = [_load_clusters(repo.clusters) for repo in repos]
    model = _load_model(args)
    policy = _policy(args)
    several = len(repos) > 1
    results: list[RepoEval] = []
    for n, (repo, clusters) in enumerate(zip(repos, loaded, strict=True), 1):
        name = _repo_name(clusters, repo)
        if several:
            print(f"== repository {n} of {len(repos)}: {name} (queries {repo.queries};"
                  f" clusters {', '.join(repo.clusters)}) ==")
        result = _evaluate(args, repo, name, clusters, model, policy)
        print(_false_alarm_line("false alarms", policy, result.in_sample_boot, result.cv_boot))
        print(_label_line(policy, result.ours, result.cv))
        results.append(result)
    pooled = _pooled(args, policy, results) if several else None

    ours = [o for r in results for o in r.ours]
    cv = [o for r in results for o in r.cv]
    curves = {"dejafix": pr_curve(ours)}
    if cv:
        curves["dejafix (cross-validated)"] = pr_curve(cv)
    for bname in results[0].baselines:
        curves[bname] = pr_curve([o for r in results for o in r.baselines[bname]])
    if args.plot:
        _, _, precision, recall = pr_at(ours, policy.threshold, policy.margin)
        if write_plot(args.plot, curves, (precision, recall)):
            print(f"plot written to {args.plot}" + (" (pooled)" if several else ""))
    if args.json_report:
        report = results[0].report if not several else {
            "repositories": [r.report for r in results], "pooled": pooled}
        with open(args.json_report, "w", encoding="utf-8") as fh:
            json.dump(report, fh, ensure_ascii=False, indent=2)
            fh.write("\n")
        print(f"report written to {args.json_report}")
    return 0


def _evaluate(args: argparse.Namespace, repo: Repository, name: str, clusters: list[Cluster],
              model: ScoreModel | None, policy: MatchPolicy) -> RepoEval:
    """One repository: index, in-sample figures, cross-validation, baselines, printed as
    ``eval`` has always printed them for one repository."""
    queries = load_labelled(repo.queries)
    started = time.perf_counter()
    matcher = Matcher(clusters, model=model)
    built = time.perf_counter() - started
    started = time.perf_counter()
    ours = matcher_outcomes(matcher, queries, policy)
    per_issue = (time.perf_counter() - started) / max(1, len(queries))
    positives = sum(1 for o in ours if o.expected)
    said, right, precision, recall = pr_at(ours, policy.threshold, policy.margin)
    r1, r5 = _recall_at(ours)
    print(
        f"{len(queries)} issues ({positives} with a cluster, {len(queries) - positives} without),"
        f" {len(clusters)} clusters; index {built * 1000:.0f} ms, {per_issue * 1000:.1f} ms/issue"
    )
    print(
        f"dejafix @ threshold {policy.threshold:.2f} margin {policy.margin:.2f}: comments {said},"
        f" right {right}: precision {precision:.3f} recall {recall:.3f}"
        f" R@1 {r1:.3f} R@5 {r5:.3f}"
    )
    print_pr_table(ours, policy.margin)
    bt, bp, br = best_threshold(ours)
    print(f"dejafix best single threshold {bt:.3f}: precision {bp:.3f} recall {br:.3f}")
    in_boot = eval_report.bootstrap_pr(ours, policy.threshold, policy.margin)

    report: dict[str, Any] = {
        "issues": len(queries),
        "positives": positives,
        "negatives": len(queries) - positives,
        "clusters": len(clusters),
        "policy": {"threshold": policy.threshold, "margin": policy.margin},
        "in_sample": {
            "comments": said, "right": right, "precision": precision, "recall": recall,
            "r1": r1, "r5": r5, "pr_table": _pr_rows(ours, policy.margin),
            "best_threshold": {"threshold": bt, "precision": bp, "recall": br},
            "false_alarms": eval_report.false_alarm_dict(in_boot),
        },
        "cross_validated": None,
        "baselines": [],
    }

    cv: list[Outcome] = []
    kinds: list[eval_report.KindRow] | None = None
    cv_boot: eval_report.BootstrapPR | None = None
    if args.cv:
        from bot.eval.fit import cross_validate

        cv = cross_validate(clusters, queries, folds=args.cv, policy=policy, matcher=matcher)
        cs, cr, cp, crec = pr_at(cv, policy.threshold, policy.margin)
        cr1, cr5 = _recall_at(cv)
        print(
            f"dejafix {args.cv}-fold cross-validated, folds grouped by cluster (model refitted"
            f" without each fold): comments {cs}, right {cr}: precision {cp:.3f}"
            f" recall {crec:.3f} R@1 {cr1:.3f} R@5 {cr5:.3f}"
        )
        print_pr_table(cv, policy.margin, prefix="cross-validated: ")
        report["cross_validated"], cv_boot, kinds = _report_cv(
            args, matcher, policy, clusters, queries, cv)

    baselines: dict[str, list[Outcome]] = {}
    if not args.no_baselines:
        from bot.eval.baselines import BASELINES

        for cls in BASELINES:
            baseline = cls(clusters)
            outcomes = baseline_outcomes(baseline, queries)
            bt, bp, br = best_threshold(outcomes)
            b1, b5 = _recall_at(outcomes)
            print(
                f"baseline {baseline.name}: best threshold {bt:.3f}: precision {bp:.3f}"
                f" recall {br:.3f} R@1 {b1:.3f} R@5 {b5:.3f}"
            )
            baselines[baseline.name] = outcomes
            report["baselines"].append({
                "name": baseline.name, "best_threshold": bt, "precision": bp, "recall": br,
                "r1": b1, "r5": b5,
            })
    # Where the figures come from; added after the keys a one-repository report always had.
    report["repository"] = name
    report["cluster_files"] = list(repo.clusters)
    report["queries_file"] = repo.queries
    return RepoEval(name=name, clusters=clusters, queries=queries, ours=ours, cv=cv, kinds=kinds,
                    in_sample_boot=in_boot, cv_boot=cv_boot, baselines=baselines, report=report)


def _report_cv(
    args: argparse.Namespace, matcher: Matcher, policy: MatchPolicy, clusters: list[Cluster],
    queries: Sequence[dict[str, Any]], cv: Sequence[Outcome],
) -> tuple[dict[str, Any], eval_report.BootstrapPR, list[eval_report.KindRow] | None]:
    """Print, after the cross-validated figures, their bootstrap interval, the by-kind table
    and the wrong comments; return all of it (and the figures) for ``--json-report``, with the
    bootstrap and the by-kind rows (None when the outcomes cannot be paired with the issues)."""
    th, margin = policy.threshold, policy.margin
    cs, cr, cp, crec = pr_at(cv, th, margin)
    cr1, cr5 = _recall_at(cv)
    boot = eval_report.bootstrap_pr(cv, th, margin)
    print(eval_report.format_bootstrap(boot, th, margin))
    out: dict[str, Any] = {
        "folds": args.cv, "comments": cs, "right": cr, "precision": cp, "recall": crec,
        "r1": cr1, "r5": cr5, "pr_table": _pr_rows(cv, margin), "bootstrap": boot.as_dict(),
        "by_kind": None, "wrong_comments": None,
        "false_alarms": eval_report.false_alarm_dict(boot),
    }
    if len(cv) != len(queries):
        # The outcomes can no longer be paired with their issues: say so, guess nothing.
        print(f"cross-validated: {len(cv)} outcomes for {len(queries)} issues; no by-kind table"
              " or wrong comments", file=sys.stderr)
        return out, boot, None
    rows = eval_report.by_kind(cv, queries, clusters, th, margin)
    print(f"cross-validated by kind @ threshold {th:.2f} margin {margin:.2f}:")
    for line in eval_report.format_kind_table(rows):
        print(f"  {line}")
    wrong = wrong_comment_report(matcher, policy, queries, cv)
    print_wrong_comments(wrong)
    out["by_kind"] = [asdict(r) for r in rows]
    out["wrong_comments"] = wrong
    return out, boot, rows


def _pooled(args: argparse.Namespace, policy: MatchPolicy, results: Sequence[RepoEval]
            ) -> dict[str, Any]:
    """Print the figures over all repositories together and return them for ``--json-report``.
    Counts are sums of the repositories' (each issue was matched against its own repository's
    clusters only); intervals resample issues within each repository."""
    th, margin = policy.threshold, policy.margin
    ours = [o for r in results for o in r.ours]
    positives = sum(1 for o in ours if o.expected)
    clusters = sum(len(r.clusters) for r in results)
    said, right, precision, recall = pr_at(ours, th, margin)
    r1, r5 = _recall_at(ours)
    in_boot = eval_report.bootstrap_pooled([r.ours for r in results], th, margin)
    print(f"== pooled over {len(results)} repositories: {len(ours)} issues ({positives} with a"
          f" cluster, {len(ours) - positives} without), {clusters} clusters; each issue matched"
          " against its own repository's clusters only ==")
    print(f"pooled dejafix @ threshold {th:.2f} margin {margin:.2f}: comments {said},"
          f" right {right}: precision {precision:.3f} recall {recall:.3f}"
          f" R@1 {r1:.3f} R@5 {r5:.3f}")
    out: dict[str, Any] = {
        "repositories": len(results),
        "names": [r.name for r in results],
        "issues": len(ours),
        "positives": positives,
        "negatives": len(ours) - positives,
        "clusters": clusters,
        "policy": {"threshold": th, "margin": margin},
        "in_sample": {
            "comments": said, "right": right, "precision": precision, "recall": recall,
            "r1": r1, "r5": r5, "pr_table": _pr_rows(ours, margin),
            "bootstrap": in_boot.as_dict(), "false_alarms": eval_report.false_alarm_dict(in_boot),
        },
        "cross_validated": None,
        "baselines": [],
    }
    cv_boot = None
    if args.cv:
        cv = [o for r in results for o in r.cv]
        cs, cr, cp, crec = pr_at(cv, th, margin)
        cr1, cr5 = _recall_at(cv)
        print(f"pooled dejafix {args.cv}-fold cross-validated, each repository on its own (folds"
              f" grouped by cluster, model refitted without each fold): comments {cs}, right {cr}:"
              f" precision {cp:.3f} recall {crec:.3f} R@1 {cr1:.3f} R@5 {cr5:.3f}")
        cv_boot = eval_report.bootstrap_pooled([r.cv for r in results], th, margin)
        print(eval_report.format_bootstrap(cv_boot, th, margin, label="pooled cross-validated"))
        rows = None
        if all(r.kinds is not None for r in results):
            rows = eval_report.pool_kind_rows([r.kinds or [] for r in results])
            print(f"pooled cross-validated by kind @ threshold {th:.2f} margin {margin:.2f}:")
            for line in eval_report.format_kind_table(rows):
                print(f"  {line}")
        out["cross_validated"] = {
            "folds": args.cv, "comments": cs, "right": cr, "precision": cp, "recall": crec,
            "r1": cr1, "r5": cr5, "pr_table": _pr_rows(cv, margin),
            "bootstrap": cv_boot.as_dict(),
            "by_kind": [asdict(r) for r in rows] if rows is not None else None,
            "false_alarms": eval_report.false_alarm_dict(cv_boot),
        }
    print(_false_alarm_line("pooled false alarms", policy, in_boot, cv_boot))
    for bname in results[0].baselines:
        outcomes = [o for r in results for o in r.baselines[bname]]
        bt, bp, br = best_threshold(outcomes)
        b1, b5 = _recall_at(outcomes)
        print(f"pooled baseline {bname}: best threshold {bt:.3f}: precision {bp:.3f}"
              f" recall {br:.3f} R@1 {b1:.3f} R@5 {b5:.3f}")
        out["baselines"].append({"name": bname, "best_threshold": bt, "precision": bp,
                                 "recall": br, "r1": b1, "r5": b5})
    return out
