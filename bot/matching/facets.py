"""Facets: the words a repository uses to say *where* a bug lives — a chat platform, a provider,
an OS, a component — learned from its own clusters, not from a hand list of names.

A word is a facet value when the repository's clusters use it as a *tag* for themselves: as a
``subsystem``, as the scope of a conventional-commit title (``fix(scanner): ...``), as a title
prefix (``Printer: ...``, ``[Pager] ...``), or as the name of a file the fix changed
(``drivers/serial.py``). Ordinary words turn up in those places too ("run" in ``run.py``); what
tells a tag from a word is how often the word is used as a tag among the clusters that say it
at all (``is_facet``). The index keeps, per cluster, the facet values it is tagged with; the
matcher then sees a conflict when the issue's title names a value the cluster never says while
the cluster is tagged with one the issue never says: the same failure on another platform.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from bot.clusters.models import Cluster
from bot.matching.evidence import is_weak_file
from bot.matching.text import tokens

# ``fix(io/scanner): ...`` -> the scope; ``feat!: ...`` has none.
_SCOPE = re.compile(r"^\s*[a-z]+\(([^)]{1,40})\)!?:", re.IGNORECASE)
# ``Printer: ...``, ``[Pager] ...``, ``[Bug]: USB: ...`` (each prefix of up to three words).
_PREFIX = re.compile(r"^\s*(?:\[([^\]]{1,30})\]:?|([A-Za-z][\w.+-]*(?:\s[\w.+-]+){0,2}):)\s")

# A tag must be used as one by at least this many clusters...
MIN_TAGGED = 2
# ...by at least this share of the clusters whose text says the word at all...
MIN_TAG_SHARE = 0.25
# ...and be said by no more than this share of all clusters (a word every cluster says, such as
# the project's own name, locates nothing).
MAX_SHARE = 0.2


def _prefixes(title: str) -> list[str]:
    out: list[str] = []
    rest = title
    for _ in range(3):
        m = _SCOPE.match(rest)
        if m:
            out.append(m.group(1))
            rest = rest[m.end():]
            continue
        m = _PREFIX.match(rest)
        if not m:
            break
        out.append(m.group(1) or m.group(2))
        rest = rest[m.end():]
    return out


def _file_name(path: str) -> str | None:
    """The name of a changed file without its extension (``drivers/serial.py``: serial); not
    of tests, docs and other weak files, nor of files at the top (``setup.py``)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) < 2 or is_weak_file(path):
        return None
    name = parts[-1].split(".", 1)[0]
    return name if name and not name.startswith("_") else None


def facet_candidates(cluster: Cluster) -> list[str]:
    """The words this cluster is tagged with (distinct tokens, in first-seen order)."""
    raw: list[str] = []
    if cluster.subsystem:
        raw.append(cluster.subsystem)
    for title in [cluster.display_label, *(m.title for m in cluster.members if m.title)]:
        raw.extend(_prefixes(title or ""))
    raw.extend(filter(None, map(_file_name, cluster.files_changed)))
    found: dict[str, None] = {}
    for text in raw:
        for t in tokens(text.replace("/", " ").replace("_", " ").replace("-", " ")):
            if len(t) >= 3 and not t.isdigit():
                found.setdefault(t, None)
    return list(found)


def is_facet(tagged: int, said: int, clusters: int) -> bool:
    """Whether a word tagged on ``tagged`` clusters, and said by ``said`` of ``clusters``, is a
    facet value."""
    said = max(said, tagged)
    return (tagged >= MIN_TAGGED and tagged >= MIN_TAG_SHARE * said
            and said <= MAX_SHARE * max(clusters, 1))


def learn(candidates: Iterable[Iterable[str]], said: dict[str, int], clusters: int) -> set[str]:
    """The facet values of a collection: ``candidates`` per cluster, ``said`` the number of
    clusters whose text has each word."""
    tagged: dict[str, int] = {}
    for words in candidates:
        for w in set(words):
            tagged[w] = tagged.get(w, 0) + 1
    return {w for w, n in tagged.items() if is_facet(n, said.get(w, n), clusters)}
