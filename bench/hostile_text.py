"""Hostile issue text against ordinary text: each text pass of matching, and the whole ranking,
on a full-size body (scoring.MAX_BODY_CHARS, 64 KB) of each hostile kind against prose of the same
length, timed in the same run; and how long the event loop waits while a thread ranks the worst
of them (a regex holds the GIL for as long as one call runs).

usage: python bench/hostile_text.py [--size 65536] [--repeats 3]

Prints, per pass, its time on prose, its worst hostile text and the ratio; then the ranking and
the loop's longest wait; last line, one JSON object with the figures. Each time is the least of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bot.features.commands import parse_commands
from bot.matching import IssueText, Matcher, learn_boilerplate
from bot.matching.boilerplate import normalise_line
from bot.matching.citations import citations
from bot.matching.evidence import extract_issue_evidence, normalise_error
from bot.matching.frames import parse_traces
from bot.matching.regression import reporter_version
from bot.matching.scoring import MAX_BODY_CHARS
from bot.matching.text import clean_body, clean_title, strip_comments, tokens
from tests.samples import FILLER, LOOKALIKE, MATCH_REPO, TARGET

PROSE = ("The renderer crashes when the animation is paused and the frame rate drops to zero; "
         "see gateway/run.py and `compute_frame_budget` (#12). ")
# (name, head, repeated unit, tail): each fills the body with its unit.
HOSTILE = [
    ("unclosed comments", "", "<!--", ""),
    ("slashes", "", "/", ""),
    ("blank line then colon", "", " ", ":"),
    ("word without chain", "x..", "a", "."),
    ("digits then dash", "", "1", "-"),
    ("url without path", "https://", "a", ""),
    ("path segments then ~.py", "", "a/", "~.py"),
    ("dotted then ;x.py", "", "a.", ";x.py"),
    ("x.py/b~", "", "x.py/b~", ""),
    ("dotted call", "", "a.", ".("),
    ("unclosed fences", "", "```\n", ""),
    ("command then one backtick run", "/dejafix help\n", "`", ""),
    ("open brackets", "", "[(", ""),
    ("one character", "", "a", ""),
    ("snake run", "", "a_", ""),
    ("citations", "", "duplicate of #1 ", ""),
    ("traceback frames", "Traceback (most recent call last):\n",
     '  File "/srv/app/widget/mod.py", line 12, in handler\n    value = compute(payload)\n', ""),
]
BOILERPLATE = learn_boilerplate([
    "### Describe the bug\nA clear and concise description of what the bug is.\n"
    "- [ ] I searched existing issues <!-- please do -->\n",
])
# Every pass an issue's text goes through when it is matched (Matcher._query, the regression
# check, the template stripping), each on one text; tests/test_hostile_text.py times the same.
PASSES: dict[str, Callable[[str], object]] = {
    "clean_title": clean_title,
    "clean_body": clean_body,
    "strip_comments": strip_comments,
    "boilerplate.strip": BOILERPLATE.strip,
    "normalise_line": normalise_line,
    "tokens": tokens,
    "tokens_keep_stopwords": lambda text: tokens(text, keep_stopwords=True),
    "extract_issue_evidence": extract_issue_evidence,
    "normalise_error": normalise_error,
    "parse_traces": parse_traces,
    "citations": lambda text: citations(text, [MATCH_REPO]),
    "reporter_version": lambda text: reporter_version("title", text),
    # Not matching, but the same kind of pass: every comment on an issue is parsed for commands,
    # on the event loop.
    "parse_commands": parse_commands,
}


def fill(head: str, unit: str, tail: str, size: int) -> str:
    return (head + unit * (size // len(unit) + 1))[: size - len(tail)] + tail


def best(fn: Callable[[str], object], text: str, repeats: int) -> float:
    out = float("inf")
    gc.disable()
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            fn(text)
            out = min(out, time.perf_counter() - started)
    finally:
        gc.enable()
    return out


async def loop_lag(rank: Callable[[str], object], body: str) -> float:
    """The longest the loop waited for a 1 ms tick while a thread ranked ``body``."""
    worst = 0.0
    job = asyncio.ensure_future(asyncio.to_thread(rank, body))
    while not job.done():
        started = time.perf_counter()
        await asyncio.sleep(0.001)
        worst = max(worst, time.perf_counter() - started - 0.001)
    await job
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=MAX_BODY_CHARS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size, repeats = args.size, args.repeats
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {size} characters")
    prose = fill("", PROSE, "", size)
    texts = {name: fill(head, unit, tail, size) for name, head, unit, tail in HOSTILE}
    report: dict[str, dict[str, object]] = {}
    print(f"{'pass':<24} {'prose ms':>9} {'worst ms':>9} {'ratio':>7}  worst text")
    for name, fn in PASSES.items():
        base = best(fn, prose, repeats)
        times = {kind: best(fn, text, repeats) for kind, text in texts.items()}
        kind = max(times, key=lambda k: times[k])
        ratio = times[kind] / max(base, 1e-6)
        report[name] = {"prose_ms": round(base * 1e3, 3), "worst_ms": round(times[kind] * 1e3, 3),
                        "ratio": round(ratio, 1), "worst": kind}
        print(f"{name:<24} {base * 1e3:>9.2f} {times[kind] * 1e3:>9.2f} {ratio:>6.1f}x  {kind}")

    matcher = Matcher([*FILLER, TARGET, LOOKALIKE])

    def rank(body: str) -> object:
        return matcher.rank(IssueText(title="Renderer hangs", body=body), boilerplate=BOILERPLATE)

    rank(prose)
    base = best(rank, prose, repeats)
    ranks = {kind: best(rank, text, repeats) for kind, text in texts.items()}
    kind = max(ranks, key=lambda k: ranks[k])
    lag_prose = asyncio.run(loop_lag(rank, prose))
    lag_worst = asyncio.run(loop_lag(rank, texts[kind]))
    print(f"\nMatcher.rank: prose {base * 1e3:.1f} ms, worst {ranks[kind] * 1e3:.1f} ms ({kind}),"
          f" {ranks[kind] / base:.1f}x; unclosed comments {ranks['unclosed comments'] * 1e3:.1f}"
          f" ms\nloop's longest wait while a thread ranks: prose {lag_prose * 1e3:.1f} ms,"
          f" worst text {lag_worst * 1e3:.1f} ms")
    print(json.dumps({"size": size, "passes": report,
                      "rank": {"prose_ms": round(base * 1e3, 2),
                               "worst_ms": round(ranks[kind] * 1e3, 2), "worst": kind,
                               "ratio": round(ranks[kind] / base, 1),
                               "comments_ms": round(ranks["unclosed comments"] * 1e3, 2),
                               "loop_lag_prose_ms": round(lag_prose * 1e3, 1),
                               "loop_lag_worst_ms": round(lag_worst * 1e3, 1)}}))


if __name__ == "__main__":
    main()
