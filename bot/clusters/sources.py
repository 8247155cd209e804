"""A repository's own known bugs, the pure part: the files and feed bodies its
``.github/dejafix.yml`` lists under ``clusters:``, checked and reduced to the clusters of that
repository. Reading them (the contents API, a checkout, a feed URL) is
``bot.features.repo_clusters``.

Only clusters of the repository itself are kept: its config file is its maintainers' to write,
and must not put answers into another repository's issues (another repository's clusters are
used through ``upstreams:``, which has its own rule)."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from bot.clusters.load import SUFFIXES, LoadError, load_clusters
from bot.clusters.models import Cluster

# A source larger than this (a file, a folder's files together, a feed) is refused whole and
# its last good version stays: every known bug of a busy repository is a few MB.
MAX_SOURCE_BYTES = 16 * 1024 * 1024
# Files read from one folder; the rest are named in a problem.
MAX_FOLDER_FILES = 200


def is_feed(entry: str) -> bool:
    return entry.startswith(("https://", "http://"))


def wanted_file(path: str) -> bool:
    """A file a ``clusters:`` folder contributes: a cluster file, not hidden."""
    name = PurePosixPath(path).name
    return PurePosixPath(name).suffix in SUFFIXES and not name.startswith(".")


@dataclass(frozen=True)
class SourceFile:
    """One file's bytes and how problems name it (its path in the repository, or a feed's
    URL without its query)."""

    shown: str
    data: bytes
    suffix: str = ""

    @property
    def kind(self) -> str:
        return self.suffix or PurePosixPath(self.shown).suffix


@dataclass(frozen=True)
class OwnClusters:
    """The valid clusters of one source as JSON Lines (as stored and indexed), how many, and
    every problem of what was left out."""

    body: str
    clusters: int
    problems: tuple[LoadError, ...]


def version_of(parts: Iterable[tuple[str, str]]) -> str:
    """One version for a source from its files' (path, version): equal when nothing changed."""
    digest = hashlib.sha256()
    for path, version in sorted(parts):
        digest.update(f"{path}\0{version}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:24]


def own_clusters(repo: str, files: list[SourceFile]) -> OwnClusters:
    """Every cluster in ``files`` (JSON, JSON Lines, markdown reports: read as the cluster
    loader reads a folder, a later definition winning) that belongs to ``repo``. CPU-bound:
    call it in a thread."""
    problems: list[LoadError] = []
    kept: dict[tuple[str, str], Cluster] = {}
    with tempfile.TemporaryDirectory(prefix="dejafix-sources-") as tmp:
        for number, source in enumerate(files):
            path = Path(tmp) / f"{number:04d}{source.kind}"
            path.write_bytes(source.data)
            report = load_clusters([path])
            problems.extend(LoadError(source.shown, e.line, e.field, e.message, e.level)
                            for e in report.errors)
            for cluster in report.clusters:
                if cluster.repo.lower() != repo.lower():
                    problems.append(LoadError(
                        source.shown, 0, "repo",
                        f"cluster {cluster.public_id} is of {cluster.repo}, not of {repo}: a "
                        "repository's clusters: describe its own bugs (name another repository "
                        "under upstreams: to use its clusters)"))
                else:
                    kept.pop(cluster.key, None)  # a later definition wins, and comes later
                    kept[cluster.key] = cluster
    body = "".join(c.model_dump_json(exclude_none=True) + "\n" for c in kept.values())
    return OwnClusters(body, len(kept), tuple(problems))

