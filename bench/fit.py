"""Fit the matcher's scoring model on labelled issues and the clusters' own pairs; print it, or
write it as the model file the bot loads (``bot/matching/model.json``).

usage: python -m bench.fit --clusters CLUSTERS.jsonl --queries LABELLED.jsonl [--l2 1.0]
       [--write bot/matching/model.json]

The fit (``bot/eval/fit.py``): the labelled issues' shortlists plus the self-supervised
pairs of ``fit.synthetic`` (each cluster's member titles against the index with and without
their cluster); relevance weights with sign constraints and a bound; calibration on out-of-fold
relevance. ``--write`` also records what the fit learned from (a hash of the clusters and
labelled issues, their counts), the constants it used, and its cross-validated figures (10
folds grouped by cluster, five fold seeds), so the file says how far to trust it. Uncertain
labels are left out, as score.py leaves them out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bot.clusters.load import load_clusters
from bot.eval import fit as F
from bot.eval.offline import load_labelled, pr_at
from bot.matching import Matcher, MatchPolicy
from bot.matching.model import features_only

_THRESHOLDS = (0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fit")
    parser.add_argument("--clusters", action="append", required=True)
    parser.add_argument("--queries", required=True)
    parser.add_argument("--l2", type=float, default=1.0, help="L2 strength of both fits.")
    parser.add_argument("--seeds", type=int, default=5, help="Fold seeds for the CV figures.")
    parser.add_argument("--write", metavar="FILE", help="Write the model file here.")
    args = parser.parse_args(argv)
    clusters = load_clusters(args.clusters).clusters
    queries = load_labelled(args.queries)
    policy = MatchPolicy()
    # The features a matcher computes do not depend on its weights (those are what is being
    # fitted), and the shipped model may lack a feature this one computes.
    matcher = Matcher(clusters, model=features_only())
    data = F.collect(matcher, queries, policy)
    extra = F.synthetic(clusters, policy)
    model = F.fit([*data, *extra], args.l2, args.l2)
    if not args.write:
        print(model.to_json())
        return 0
    cv: dict[str, Any] = {}
    for seed in range(args.seeds):
        outcomes = F.cross_validate(clusters, queries, policy=policy, l2_rel=args.l2,
                                    l2_cal=args.l2, matcher=matcher, extra=extra, seed=seed)
        for th in _THRESHOLDS:
            said, right, p, r = pr_at(outcomes, th, policy.margin)
            cv.setdefault(f"{th:.2f}", []).append(
                {"comments": said, "right": right, "precision": round(p, 3),
                 "recall": round(r, 3)})
    record = {
        "format": 1,
        "about": "Dejafix's scoring model: relevance weights over the evidence features, then"
                 " a logistic calibration on (relevance, lead over the runner-up).",
        "refit": "python -m bench.fit "
                 + " ".join(f"--clusters {c}" for c in args.clusters)
                 + f" --queries {args.queries} --write {args.write}",
        "constants": {
            "l2": args.l2,
            "fixed_weights": F.FIXED_WEIGHTS,
            "against": sorted(F.AGAINST),
            "max_weight": F.MAX_WEIGHT,
            "synthetic_weight": F.SYNTHETIC_WEIGHT,
            "calibration": "out-of-fold relevance, 5 inner folds grouped by cluster",
        },
        "training": {
            "data_sha256": F.data_digest(clusters, queries),
            "clusters": len(clusters),
            "labelled_issues": len(data),
            "labelled_positives": sum(1 for q in data if q.expected),
            "synthetic_pairs": len(extra),
        },
        "cross_validated": {
            "how": "10 folds grouped by cluster (the clusters' own pairs of a held-out"
                   " cluster left out too), margin 0.05, a possible regression counted"
                   " as silent; one entry per fold seed",
            "by_threshold": cv,
        },
        "model": model.to_dict(),
    }
    Path(args.write).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.write}")
    for th, runs in cv.items():
        print(f"  cv @ {th}: " + "  ".join(
            f"{r['comments']} {r['precision']:.3f}/{r['recall']:.3f}" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
