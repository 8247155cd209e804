"""A seeded generator of realistic cluster records, recombined from the real ones.

usage: python bench/gen_clusters.py N [--seed S] [--include-real] [--source CLUSTERS.jsonl] [-o OUT]

The benchmarks need 1k, 10k and 100k clusters of one repository; the real feed has a few
hundred. Copying the real clusters over and over would put every real word in hundreds of
clusters (a rare identifier would become common, and every posting list would grow with the
corpus); made-up text would have a vocabulary no matcher ever sees. So each generated cluster is
a real one (its *template*) rewritten:

- its shape is the template's: how many members, of which kind and state, a release-note
  one-liner or an issue thread, how many files each PR changed, which PR is the fix;
- its text (label, summary, member titles) is the template's, the label sometimes spliced with
  the end of another real label, and each distinct word of the template rewritten *once for the
  whole cluster* (so the label, the summary and the titles still share their words, as a real
  cluster's do). A common word (in 1% of the real clusters or more) is kept or replaced by a
  common word drawn by frequency, so its share of clusters stays what it is in the real feed. A
  rare word is kept less often the larger the corpus (with probability 0.6 / sqrt(size / real))
  and otherwise becomes a new product-like word (cut from two real words) from a pool that grows
  with the corpus, so a rare word's document frequency grows as the square root of the corpus
  and the vocabulary keeps growing (Heaps' law: a larger repository has more platforms,
  providers and features), instead of every real word being in hundreds of clusters;
- its code (file paths, identifiers in the text, fix-hunk symbols): a template's own name is
  kept as rarely as a rare word (0.2 / sqrt(size / real)); otherwise a name is drawn from a pool
  that starts with the real paths and identifiers and goes on with new ones recombined from
  their parts (a real directory and real stems; snake_case names of the parts of real names).
  The pool open to cluster ``i`` grows as ``(i / real) ** 0.7`` and is drawn from by a power law
  (``(k + 1) ** -0.8``), so a few files are touched by many fixes and most by few, as in a real
  repository;
- merged fix PRs that changed files get diff hunks (``@@`` headers naming a function, removed
  and added lines calling others) for most of their files, with the cluster's own identifiers
  among the symbols, so symbol evidence exists at every size (the real feed has none; the seed
  clusters show the shape).

Every generated cluster has a unique ``public_id`` (its first member's number, as in the real
feed), unique member numbers above the real ones, and the repository of the real clusters.
Deterministic for a seed, and prefix-stable: cluster ``i`` depends only on the seed and ``i``,
so ``generate(n)[:k] == generate(k)``. ``include_real`` puts the real clusters first, verbatim,
so that labelled queries keep their answer among the generated distractors.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = ROOT.parent / "shared" / "eval" / "clusters.jsonl"
FIRST_NUMBER = 200_000  # generated issue and PR numbers start above the real ones
NUMBERS_PER_CLUSTER = 16  # each cluster numbers its members from its own block
VOCAB_GROWTH = 0.7  # pools of names grow as (corpus size / real size) ** VOCAB_GROWTH
KEEP_WORD = 0.6  # share of a template's common prose words kept (the rest replaced)
COMMON_DF = 0.01  # a word in at least this share of the real clusters is common
KEEP_CODE = 0.2  # share of a template's paths and identifiers kept verbatim, at the real size
ZIPF_CODE = 0.8  # exponent of the power law that paths and identifiers are drawn by

_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_./-]*[A-Za-z0-9]|[A-Za-z]")
_PATHLIKE = re.compile(
    r"[\w.-]+(?:/[\w.-]+)*\.(?:py|pyi|ts|tsx|js|jsx|mjs|md|json|yaml|yml|toml|sh|css|html|go|rs)"
)
_IDENT = re.compile(r"_*[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+_*|[a-z]+(?:[A-Z][a-z0-9]+){2,}")
_SENTENCE = re.compile(r"(?<=[.;])\s+")
# Function words: kept as they are (they carry no evidence, and swapping them would make every
# generated text richer in content words than a real one).
_FUNCTION_TEXT = """a about above after again against all also am an and any are as at be because
    been before being below between both but by can cannot could did do does doing down during each
    either even ever every few for from further had has have having he her here hers him his
    how however if in into is it its itself just last least less may me might more most must
    my never new next no nor not now of off often on once one only or other our out over own
    per rather same several she should since so some still such than that the their them then
    there these they this those though through thus to too two under until up upon us use used
    uses using very via was we were what when where whether which while who whom whose why will
    with within without would yet you your"""
_FUNCTION_WORDS = frozenset(_FUNCTION_TEXT.split())

# A text as (separator before, word, class) triples, so recombining never parses it again.
Tokens = list[tuple[str, str, int]]
_KEEP, _PATH, _SYMBOL, _PROSE, _COMMON = 0, 1, 2, 3, 4  # _COMMON: set once df is known


def tokenise(text: str) -> Tokens:
    out: Tokens = []
    last = 0
    for m in _WORD.finditer(text):
        w = m.group(0)
        if _PATHLIKE.fullmatch(w):
            cls = _PATH
        elif _IDENT.fullmatch(w):
            cls = _SYMBOL
        elif len(w) <= 2 or w.lower() in _FUNCTION_WORDS or not w.isalpha():
            cls = _KEEP
        else:
            cls = _PROSE
        out.append((text[last : m.start()], w, cls))
        last = m.end()
    if last < len(text):
        out.append((text[last:], "", _KEEP))
    return out


def untokenise(text: Tokens) -> str:
    return "".join(sep + w for sep, w, _ in text)


@dataclass
class Template:
    """A real cluster, its texts tokenised once."""

    record: dict[str, Any]
    label: Tokens
    summary: list[Tokens]  # sentences
    titles: list[Tokens | None]  # one per member


@dataclass
class Pools:
    """What the generator recombines, read from the real clusters."""

    repo: str
    templates: list[Template]
    labels: list[Tokens]
    words: list[str]  # prose words with their real multiplicity (drawn by frequency)
    word_parts: list[str]  # distinct longer words, cut and joined into new product-like words
    files: list[str]  # distinct real paths, most often changed first
    dirs: list[str]
    stems: list[str]
    exts: list[str]  # with multiplicity
    symbols: list[str]  # distinct real identifiers, most frequent first
    symbol_parts: list[str]
    word_df: dict[str, int]  # in how many real clusters a (lower-cased) word appears
    common_words: list[str]  # the words of at least common_df clusters, with multiplicity
    common_df: float
    _made: dict[tuple[str, int], str] = field(default_factory=dict)

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> Pools:
        if not records:
            raise ValueError("no real clusters to recombine")
        repos = sorted({r["repo"] for r in records})
        templates: list[Template] = []
        words: list[str] = []
        word_df: dict[str, int] = {}
        symbol_count: dict[str, int] = {}
        file_count: dict[str, int] = {}
        for r in records:
            label = tokenise(r.get("display_label") or "")
            summary = [tokenise(s) for s in _SENTENCE.split(r.get("summary") or "") if s]
            titles = [tokenise(m["title"]) if m.get("title") else None
                      for m in r.get("members", [])]
            templates.append(Template(r, label, summary, titles))
            seen: set[str] = set()
            for text in [label, *summary, *(t for t in titles if t)]:
                for _, w, kind in text:
                    if kind == _PROSE:
                        words.append(w)
                        if w.lower() not in seen:
                            seen.add(w.lower())
                            word_df[w.lower()] = word_df.get(w.lower(), 0) + 1
                    elif kind == _SYMBOL:
                        symbol_count[w] = symbol_count.get(w, 0) + 1
            for m in r.get("members", []):
                for f in [*(m.get("files_changed") or []),
                          *(fh["file"] for fh in m.get("fix_hunks") or [])]:
                    file_count[f] = file_count.get(f, 0) + 1
        files = sorted(file_count, key=lambda f: (-file_count[f], f)) or ["src/main.py"]
        dirs = sorted({f.rsplit("/", 1)[0] for f in files if "/" in f} | {""})
        stems = sorted({f.rsplit("/", 1)[-1].split(".")[0].lstrip("_") for f in files} - {""})
        exts = [f.rsplit(".", 1)[-1] for f in files if "." in f.rsplit("/", 1)[-1]] or ["py"]
        symbols = sorted(symbol_count, key=lambda s: (-symbol_count[s], s)) or ["handle_event"]
        parts = sorted(
            {p.lower() for s in symbols for p in s.strip("_").split("_") if len(p) > 2 and
             p.isalpha()}
            | {p for s in stems for p in s.split("_") if len(p) > 2 and p.isalpha()}
        ) or ["handle", "event"]
        words = words or ["error"]
        word_df = word_df or {"error": len(records)}
        word_parts = sorted({w.lower() for w in words if len(w) >= 5}) or ["widget", "gadget"]
        common_df = max(2.0, COMMON_DF * len(records))

        def tag(text: Tokens) -> Tokens:
            return [(sep, w, _COMMON if kind == _PROSE and word_df[w.lower()] >= common_df
                     else kind) for sep, w, kind in text]

        for t in templates:
            t.label = tag(t.label)
            t.summary = [tag(s) for s in t.summary]
            t.titles = [tag(x) if x is not None else None for x in t.titles]
        return cls(
            repo=repos[0],
            templates=templates,
            labels=[t.label for t in templates if t.label],
            words=words,
            word_parts=word_parts,
            files=files,
            dirs=dirs,
            stems=stems or ["main"],
            exts=exts,
            symbols=symbols,
            symbol_parts=parts,
            word_df=word_df,
            common_words=[w for w in words if word_df[w.lower()] >= common_df] or words,
            common_df=common_df,
        )

    # --- growing vocabularies: name k of a kind is the same whatever the corpus size ----------

    def made(self, kind: str, k: int, seed: int) -> str:
        key = (kind, k)
        found = self._made.get(key)
        if found is None:
            found = self._make(kind, k, random.Random(f"{seed}:{kind}:{k}"))
            self._made[key] = found
        return found

    def _make(self, kind: str, k: int, rng: random.Random) -> str:
        if kind == "file":
            if k < len(self.files):
                return self.files[k]
            folder = rng.choice(self.dirs)
            stem = rng.choice(self.stems)
            if rng.random() < 0.8:
                extra = rng.choice(self.symbol_parts)
                stem = f"{stem}_{extra}" if rng.random() < 0.5 else f"{extra}_{stem}"
            ext = rng.choice(self.exts)
            if ext == "py" and rng.random() < 0.15:
                folder = f"tests/{folder}" if folder else "tests"
                stem = "test_" + stem
            return f"{folder}/{stem}.{ext}" if folder else f"{stem}.{ext}"
        if kind == "symbol":
            if k < len(self.symbols):
                return self.symbols[k]
            name = "_".join(rng.choice(self.symbol_parts)
                            for _ in range(2 if rng.random() < 0.6 else 3))
            return "_" + name if rng.random() < 0.3 else name
        if kind == "word":
            a, b = rng.choice(self.word_parts), rng.choice(self.word_parts)
            word = a[: max(2, len(a) // 2)] + b[len(b) // 2 :]
            return word.capitalize() if rng.random() < 0.5 else word
        raise ValueError(kind)

    def open_size(self, base: int, i: int) -> int:
        """How many names of a pool that starts with ``base`` real ones cluster ``i`` draws
        from: the real ones alone for the first ``len(templates)`` clusters, then more."""
        scale = max(1.0, (i + 1) / len(self.templates))
        return max(1, int(base * scale**VOCAB_GROWTH))


def _zipf(rng: random.Random, size: int, a: float = ZIPF_CODE) -> int:
    """An index in [0, size); index k comes about as often as (k + 1) ** -a (0 < a < 1)."""
    top = (size + 1) ** (1.0 - a) - 1.0
    return min(size - 1, int((1.0 + top * rng.random()) ** (1.0 / (1.0 - a))) - 1)


class _Writer:
    """Rewrites one template into one generated cluster's text."""

    def __init__(self, pools: Pools, rng: random.Random, i: int, seed: int) -> None:
        self.p, self.rng, self.seed = pools, rng, seed
        self.files_open = pools.open_size(len(pools.files), i)
        self.symbols_open = pools.open_size(len(pools.symbols), i)
        # New words: none while the corpus is no larger than the real one, more as it grows.
        self.words_open = pools.open_size(len(pools.word_parts), i) - len(pools.word_parts)
        # A rare word or a name of the template is kept less often the larger the corpus, so
        # that its document frequency grows as the square root of the corpus, not linearly.
        shrink = max(1.0, (i + 1) / len(pools.templates)) ** 0.5
        self.keep_rare = KEEP_WORD / shrink
        self.keep_code = KEEP_CODE / shrink
        self.mapping: dict[str, str] = {}  # a template word -> its replacement in this cluster
        self.symbols_used: list[str] = []

    def file(self) -> str:
        return self.p.made("file", _zipf(self.rng, self.files_open), self.seed)

    def symbol(self) -> str:
        return self.p.made("symbol", _zipf(self.rng, self.symbols_open), self.seed)

    def _replace(self, w: str, kind: int) -> str:
        r = self.rng.random()
        if kind == _PATH:
            return w if r < self.keep_code else self.file()
        if kind == _SYMBOL:
            new = w if r < self.keep_code else self.symbol()
            self.symbols_used.append(new)
            return new
        common = kind == _COMMON
        if r < (KEEP_WORD if common else self.keep_rare):
            return w
        if common:
            new = self.rng.choice(self.p.common_words)
        elif self.words_open > 0:
            # A rare word stays rare: it becomes a new word (one of a pool that grows with the
            # corpus), never one that the corpus then repeats in proportion to its size.
            new = self.p.made("word", self.rng.randrange(self.words_open), self.seed)
        else:
            new = self.rng.choice(self.p.words)
        # Keep the case shape of the template (a capitalised first word stays capitalised).
        return new.capitalize() if w[:1].isupper() and new.islower() else new

    def text(self, tokens: Tokens) -> str:
        mapping = self.mapping
        out: list[str] = []
        for sep, w, kind in tokens:
            if kind != _KEEP:
                new = mapping.get(w)
                if new is None:
                    new = mapping[w] = self._replace(w, kind)
                w = new
            out.append(sep)
            out.append(w)
        return "".join(out)

    def label(self, template: Template) -> str:
        tokens = template.label
        if self.rng.random() < 0.3:  # spliced with the end of another real label
            other = self.rng.choice(self.p.labels)
            if len(tokens) > 3 and len(other) > 3:
                cut = self.rng.randint(2, len(tokens) - 1)
                tokens = tokens[:cut] + other[self.rng.randint(1, len(other) - 2) :]
        return self.text(tokens)

    def hunk(self, line: int) -> str:
        own = self.symbols_used
        fn = self.rng.choice(own) if own and self.rng.random() < 0.5 else self.symbol()
        callee, new = self.symbol(), self.symbol()
        arg, var = self.rng.choice(self.p.symbol_parts), self.rng.choice(self.p.symbol_parts)
        added = self.rng.randint(1, 5)
        lines = [
            f"@@ -{line},7 +{line},{7 + added} @@ def {fn}(self, {arg}):",
            f"         {arg} = self.{self.rng.choice(self.p.symbol_parts)}({arg})",
            f"-        {var} = {callee}({arg})",
            f"+        {var} = {new}({arg}, timeout={self.rng.choice((5, 10, 30, 60))})",
        ]
        lines.extend(f"+        {self.symbol()}({var})" for _ in range(added - 1))
        lines.append(f"         return {var}")
        return "\n".join(lines)


def _cluster(pools: Pools, i: int, seed: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}:cluster:{i}")
    t = rng.choice(pools.templates)
    src = t.record
    w = _Writer(pools, rng, i, seed)
    base = FIRST_NUMBER + NUMBERS_PER_CLUSTER * i
    old_members = src.get("members", [])[: NUMBERS_PER_CLUSTER - 1]
    renumber: dict[Any, int] = {}
    for m in old_members:
        renumber.setdefault(m["number"], base + len(renumber))
    old_pr = (src.get("landed_fix") or {}).get("pr")
    if old_pr is not None and old_pr not in renumber:
        renumber[old_pr] = base + len(renumber)
    fix_pr = renumber.get(old_pr)

    label = w.label(t)
    summary = " ".join(w.text(s) for s in t.summary)
    members: list[dict[str, Any]] = []
    for m, title in zip(old_members, t.titles, strict=False):
        number = renumber[m["number"]]
        kind = m.get("kind", "issue")
        new: dict[str, Any] = {
            "kind": kind,
            "number": number,
            "title": w.text(title) if title is not None else None,
            "url": f"https://github.com/{pools.repo}/{'pull' if kind == 'pr' else 'issues'}/"
                   f"{number}",
            "state": m.get("state", "unknown"),
        }
        for key in ("merged", "is_fix_pr", "fix_tier"):
            if key in m:
                new[key] = m[key]
        old_files = m.get("files_changed") or []
        if old_files:
            files: dict[str, None] = {}
            for f in old_files:
                mapped = w.mapping.get(f)
                if mapped is None:
                    mapped = w.mapping[f] = f if rng.random() < w.keep_code else w.file()
                files[mapped] = None
            new["files_changed"] = list(files)
            if m.get("merged") or m.get("is_fix_pr"):
                code = [f for f in files if "test" not in f and not f.endswith(".md")]
                new["fix_hunks"] = [
                    {"file": f, "hunks": [w.hunk(rng.randint(10, 5000))
                                          for _ in range(rng.randint(1, 3))]}
                    for f in code[:3] if rng.random() < 0.8
                ]
        cr = m.get("close_reason")
        if cr:
            new["close_reason"] = {
                "category": cr.get("category"),
                **({"implication": cr["implication"]} if cr.get("implication") else {}),
                "refs": [
                    {"kind": ref.get("kind"),
                     "value": f"#{renumber.get(ref.get('number'), fix_pr)}",
                     "number": renumber.get(ref.get("number"), fix_pr)}
                    for ref in cr.get("refs", [])
                ],
            }
        members.append(new)
    first = members[0]["number"] if members else base
    edges = [
        {**e, "issue_number": renumber.get(e.get("issue_number"), first),
         "pr_number": renumber.get(e.get("pr_number"), fix_pr)}
        for e in src.get("fix_edges", [])
    ]
    issues = [m for m in members if m["kind"] != "pr"]
    prs = [m for m in members if m["kind"] == "pr"]
    open_issues = sum(1 for m in issues if m["state"] == "open")
    return {
        "repo": pools.repo,
        "public_id": str(first),
        "display_label": label,
        "summary": summary,
        "subsystem": src.get("subsystem"),
        "cluster_kind": src.get("cluster_kind"),
        "landed_fix": {**(src.get("landed_fix") or {}), "pr": fix_pr},
        "resolution": {**(src.get("resolution") or {}),
                       "by": f"pr-{fix_pr}" if fix_pr is not None else None},
        "freshness": dict(src.get("freshness") or {}),
        "grouping": dict(src.get("grouping") or {}),
        "fix_edges": edges,
        "members": members,
        "trust": dict(src.get("trust") or {}),
        "counts": {
            "members": len(members),
            "open_issues": open_issues,
            "open_issues_distinct": open_issues,
            "open_prs": sum(1 for m in prs if m["state"] == "open"),
            "closed_issues": sum(1 for m in issues if m["state"] == "closed"),
            "merged_prs": sum(1 for m in prs if m.get("merged")),
            "attempt_prs": sum(1 for m in prs if not m.get("merged")),
        },
    }


def load_real(source: Path | str = DEFAULT_SOURCE) -> list[dict[str, Any]]:
    """The real cluster records (JSON Lines)."""
    with open(source, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


_POOLS: dict[str, Pools] = {}


def pools_for(source: Path | str = DEFAULT_SOURCE) -> Pools:
    key = str(Path(source).resolve())
    if key not in _POOLS:
        _POOLS[key] = Pools.from_records(load_real(source))
    return _POOLS[key]


def iter_generate(n: int, seed: int = 0, *, source: Path | str = DEFAULT_SOURCE,
                  include_real: bool = False) -> Iterator[dict[str, Any]]:
    """``n`` cluster records (plain dicts in the seed schema), one at a time, deterministic
    for ``seed``. With ``include_real`` the real clusters come first, verbatim, and count
    towards ``n``."""
    pools = pools_for(source)
    real = [t.record for t in pools.templates[:n]] if include_real else []
    for record in real:
        yield json.loads(json.dumps(record))
    for i in range(n - len(real)):
        yield _cluster(pools, i, seed)


def generate(n: int, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
    """``iter_generate`` as a list."""
    return list(iter_generate(n, seed, **kwargs))


def generate_clusters(n: int, seed: int = 0, **kwargs: Any) -> list[Any]:
    """The same records validated as ``bot.clusters.models.Cluster``."""
    from bot.clusters.models import Cluster

    return [Cluster.model_validate(r) for r in iter_generate(n, seed, **kwargs)]


def write_jsonl(path: Path | str, n: int, seed: int = 0, **kwargs: Any) -> Path:
    """Write ``generate(n, seed, ...)`` as JSON Lines, the format the bot loads."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as fh:
        for record in iter_generate(n, seed, **kwargs):
            fh.write(json.dumps(record, ensure_ascii=False))
            fh.write("\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/gen_clusters.py",
                                     description="Generate N realistic cluster records.")
    parser.add_argument("n", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source", default=str(DEFAULT_SOURCE),
                        help="real clusters to recombine (JSON Lines)")
    parser.add_argument("--include-real", action="store_true",
                        help="put the real clusters first, verbatim")
    parser.add_argument("-o", "--out", default="-", help="output file (default: stdout)")
    args = parser.parse_args(argv)
    if args.out == "-":
        for record in iter_generate(args.n, args.seed, source=args.source,
                                    include_real=args.include_real):
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        write_jsonl(args.out, args.n, args.seed, source=args.source,
                    include_real=args.include_real)
    return 0


if __name__ == "__main__":
    sys.exit(main())
