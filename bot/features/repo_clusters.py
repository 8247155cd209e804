"""A repository's own known bugs: what its ``.github/dejafix.yml`` lists under ``clusters:``.

Each entry is a file or folder of the repository (read from its default branch through the
contents API by the App, from the checkout by the Action) or a feed URL (JSON Lines in the seed
schema). Each entry's last good version (its valid clusters of this repository, as JSON Lines)
is kept in the store beside the operator's feeds, keyed ``repo:<owner/name>:<entry>``, so every
process shares it and a restart reads nothing again. Every process writes the stored versions
as files under ``<data dir>/repo-clusters/``, a folder of the curated index like the feeds'.

When an entry is read again:
- the first issue of a repository whose entries are not all stored (a new or changed list);
- a push to the default branch touching an entry (or the config file: the list may change);
- an hour after its last read (a push the App did not see; a feed's new version). An unchanged
  file or folder costs a conditional request (its ETag: no rate limit) and nothing else; a
  changed one is read by blob.

A source that cannot be read (GitHub down, a feed unreachable, over the size bound) keeps its
last good version; one that no longer exists (a file deleted, an entry removed) takes its
clusters with it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ipaddress
import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import gidgethub
from aiohttp.abc import AbstractResolver, ResolveResult
from gidgethub.routing import Router
from gidgethub.sansio import Event
from yarl import URL

from bot.clusters.feeds import shown
from bot.clusters.load import LoadError
from bot.clusters.sources import (
    MAX_FOLDER_FILES,
    MAX_SOURCE_BYTES,
    OwnClusters,
    SourceFile,
    is_feed,
    own_clusters,
    version_of,
    wanted_file,
)
from bot.db.store import Feed, Store
from bot.features.config_check import commit_sha, post_check, push_changes_config
from bot.features.context import Context, resolve_config_text
from bot.features.fetch import FetchRefused, fetch_bounded
from bot.features.installs import installed_repos
from bot.features.repo_sources import repo_prefix, source_key
from bot.github.client import RepoClient
from bot.repo_config import CONFIG_PATH, RepoConfig, RepoConfigError

log = logging.getLogger("dejafix.repo_clusters")
router = Router()

CHECK_NAME = "dejafix known bugs"
# An entry is read again this long after its last read, pushes or not.
RECHECK_SECONDS = 3600.0
FEED_TIMEOUT = 30.0


# --- reading a repository's files ---------------------------------------------------------------

class FileReader(Protocol):
    """Where a repository's files are read: ``listing`` gives a file's or folder's files as
    (path, version), None when the path does not exist; ``read`` gives one file's bytes."""

    async def listing(self, entry: str) -> list[tuple[str, str]] | None: ...

    async def read(self, path: str, version: str) -> bytes: ...


class ContentsReader:
    """The default branch (or ``ref``: a pull request's head), through the contents API."""

    def __init__(self, client: RepoClient, ref: str | None = None) -> None:
        self.client = client
        self.ref = ref
        self._inline: dict[str, bytes] = {}

    async def listing(self, entry: str) -> list[tuple[str, str]] | None:
        data = await self.client.contents(entry, self.ref)
        if data is None:
            return None
        if isinstance(data, dict):
            if data.get("type") != "file":
                return []
            # The answer must be the file asked for, whatever the URL became on its way.
            if data.get("path") != entry:
                raise SourceError(f"GitHub answered for {str(data.get('path'))[:200]!r}")
            _bound([data])
            sha = str(data.get("sha") or "")
            if data.get("encoding") == "base64" and data.get("content"):
                self._inline[sha] = await asyncio.to_thread(base64.b64decode,
                                                            str(data["content"]))
            return [(entry, sha)]
        files = [e for e in data if isinstance(e, dict) and e.get("type") == "file"
                 and wanted_file(str(e.get("path") or ""))]
        if any(e.get("path") != f"{entry}/{e.get('name')}" or "/" in str(e.get("name"))
               for e in files):
            raise SourceError("GitHub answered with files of another folder")
        files = files[:MAX_FOLDER_FILES + 1]
        _bound(files[:MAX_FOLDER_FILES])
        return [(str(e["path"]), str(e.get("sha") or "")) for e in files]

    async def read(self, path: str, version: str) -> bytes:
        inline = self._inline.get(version)
        return inline if inline is not None else await self.client.blob(version)


class CheckoutReader:
    """A checkout of the repository (the Action): paths that leave it are refused."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def _path(self, relative: str) -> Path | None:
        target = (self.root / relative).resolve()
        return target if target == self.root or self.root in target.parents else None

    async def listing(self, entry: str) -> list[tuple[str, str]] | None:
        return await asyncio.to_thread(self._listing, entry)

    def _listing(self, entry: str) -> list[tuple[str, str]] | None:
        path = self._path(entry)
        if path is None:
            raise SourceError(f"{entry} leaves the repository (a symlink out of the checkout)")
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and wanted_file(p.name)
                           and self._path(str(p.relative_to(self.root))) is not None)
        else:
            return None
        files = files[:MAX_FOLDER_FILES + 1]
        if sum(p.stat().st_size for p in files[:MAX_FOLDER_FILES]) > MAX_SOURCE_BYTES:
            raise SourceError(f"larger than {MAX_SOURCE_BYTES} bytes")
        return [(str(p.relative_to(self.root)), _digest(p)) for p in files]

    async def read(self, path: str, version: str) -> bytes:
        target = self._path(path)
        if target is None:
            raise SourceError(f"{path} leaves the repository")
        return await asyncio.to_thread(target.read_bytes)


def _bound(files: list[dict[str, Any]]) -> None:
    """Refuse a source before reading it when its files together exceed the bound (the listing
    says their sizes): nothing that large is downloaded."""
    total = 0
    for entry in files:
        size = entry.get("size")
        total += size if isinstance(size, int) and size > 0 else 0
    if total > MAX_SOURCE_BYTES:
        raise SourceError(f"larger than {MAX_SOURCE_BYTES} bytes")


def _digest(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


class SourceError(Exception):
    """A source that cannot be read now: its last good version stays."""


# --- reading a feed -------------------------------------------------------------------------------

class PublicResolver(AbstractResolver):
    """Resolves only to public addresses: a repository's config must not make the App's server
    fetch its own network (a metadata service, an admin port). Checked on the addresses the
    connection then uses, so a name re-pointed between check and connect does not get through."""

    def __init__(self) -> None:
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        for entry in found:
            if not ipaddress.ip_address(entry["host"]).is_global:
                raise OSError(f"{host} is not a public address")
        return found

    async def close(self) -> None:
        await self._inner.close()


def _feed_refusal(url: str, private_ok: bool) -> str | None:
    try:
        # The host as aiohttp will connect to it (after IDNA: circled or full-width digits
        # become an address literal, which no resolver sees).
        host = URL(url).raw_host
    except ValueError:
        return "not a valid URL"
    if not host:
        return "no host"
    if private_ok:
        return None
    if urlsplit(url).scheme != "https":
        return "only https feeds are read"
    if not urlsplit(url).hostname or not urlsplit(url).hostname.isascii():  # type: ignore[union-attr]
        return "only an ASCII host name is read"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None  # a name: the resolver checks its addresses
    return None if address.is_global else "not a public address"


async def _fetch_feed(url: str, etag: str | None, *, private_ok: bool
                      ) -> tuple[bytes | None, str | None]:
    """(body, etag); the body None when unchanged (304)."""
    refusal = _feed_refusal(url, private_ok)
    if refusal is not None:
        raise SourceError(refusal)
    connector = aiohttp.TCPConnector(resolver=None if private_ok else PublicResolver())
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            data, etag = await fetch_bounded(session, url, etag=etag, limit=MAX_SOURCE_BYTES,
                                             timeout=FEED_TIMEOUT, redirects=False)
    except FetchRefused as exc:
        raise SourceError(str(exc)) from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise SourceError(str(exc) or type(exc).__name__) from None
    return data, etag


# --- one entry, one repository ----------------------------------------------------------------

@dataclass(frozen=True)
class Synced:
    """What reading one entry did: ``changed`` (a new version stored), ``unchanged``, or
    ``failed`` (``error``; the last good version kept)."""

    entry: str
    outcome: str
    clusters: int = 0
    problems: tuple[LoadError, ...] = ()
    error: str | None = None


async def sync_entry(store: Store, repo: str, entry: str, reader: FileReader | None, *,
                     private_feeds: bool, stored: Feed | None = None) -> Synced:
    key = source_key(repo, entry)
    listing: list[tuple[str, str]] | None = None
    try:
        if is_feed(entry):
            data, version = await _fetch_feed(
                entry, stored.etag if stored is not None and stored.clusters else None,
                private_ok=private_feeds)
            if data is None:
                await asyncio.to_thread(store.feed_polled, key, None)
                return Synced(entry, "unchanged", stored.clusters if stored else 0)
            files = [SourceFile(shown(entry), data, ".jsonl")]
            version = version or hashlib.sha256(data).hexdigest()[:24]
        else:
            if reader is None:
                raise SourceError("the repository's files cannot be read here")
            listing = await reader.listing(entry)
            if listing is None:
                files, version = [], "missing"
            else:
                version = version_of(listing)
                if stored is not None and stored.etag == version and not stored.error:
                    await asyncio.to_thread(store.feed_polled, key, None)
                    return Synced(entry, "unchanged", stored.clusters)
                files = await _read_files(reader, listing)
    except (SourceError, gidgethub.GitHubException, aiohttp.ClientError, OSError,
            ValueError) as exc:
        error = _without_url(str(exc) or type(exc).__name__, entry)
        await asyncio.to_thread(store.feed_polled, key, error)
        return Synced(entry, "failed", stored.clusters if stored else 0, error=error)
    parsed, problems = await _parse(repo, entry, listing, files)
    if stored is not None and stored.etag == version and stored.body == parsed.body:
        await asyncio.to_thread(store.feed_polled, key, None)
        return Synced(entry, "unchanged", parsed.clusters, tuple(problems))
    await asyncio.to_thread(store.put_feed, key, version, parsed.body, parsed.clusters,
                            "\n".join(map(str, problems)))
    return Synced(entry, "changed", parsed.clusters, tuple(problems))


async def _parse(repo: str, entry: str, listing: list[tuple[str, str]] | None,
                 files: list[SourceFile]) -> tuple[OwnClusters, list[LoadError]]:
    """The repository's clusters in an entry's files, and every problem (the entry's own
    included: not found, nothing in it, cut)."""
    if not files:
        return OwnClusters("", 0, ()), [LoadError(
            entry, 0, None, "not found" if listing is None and not is_feed(entry)
            else "no cluster file (.json, .jsonl, .md) in it")]
    parsed = await asyncio.to_thread(own_clusters, repo, files)
    problems = list(parsed.problems)
    if listing is not None and len(listing) > MAX_FOLDER_FILES:
        problems.append(LoadError(entry, 0, None,
                                  f"only its first {MAX_FOLDER_FILES} files are read"))
    return parsed, problems


async def check_files(repo: str, entries: list[str], reader: FileReader) -> list[Synced]:
    """Read the file entries as ``sync_entry`` does, storing nothing: a pull request's
    version, checked before it is merged."""
    done = []
    for entry in entries:
        if is_feed(entry):
            continue  # not part of a commit
        listing = None
        try:
            listing = await reader.listing(entry)
            files = await _read_files(reader, listing) if listing is not None else []
        except (SourceError, gidgethub.GitHubException, aiohttp.ClientError, OSError,
                ValueError) as exc:
            done.append(Synced(entry, "failed", error=str(exc) or type(exc).__name__))
            continue
        parsed, problems = await _parse(repo, entry, listing, files)
        done.append(Synced(entry, "changed", parsed.clusters, tuple(problems)))
    return done


def _without_url(text: str, entry: str) -> str:
    """An error's text without the feed's URL (aiohttp puts it in some): its query may carry a
    tracker's token, and the text reaches logs, check runs and annotations."""
    if not is_feed(entry):
        return text
    text = text.replace(entry, shown(entry))
    query = urlsplit(entry).query
    return text.replace(query, "…") if query else text


async def _read_files(reader: FileReader, listing: list[tuple[str, str]]) -> list[SourceFile]:
    files: list[SourceFile] = []
    total = 0
    for path, version in listing[:MAX_FOLDER_FILES]:
        data = await reader.read(path, version)
        total += len(data)
        if total > MAX_SOURCE_BYTES:
            raise SourceError(f"larger than {MAX_SOURCE_BYTES} bytes")
        files.append(SourceFile(path, data))
    return files


async def sync_repo(store: Store, repo: str, entries: list[str], reader: FileReader | None, *,
                    private_feeds: bool, force_files: bool = False, force_feeds: bool = False,
                    now: float | None = None, drop: bool = True) -> list[Synced]:
    """Bring the stored versions of ``repo``'s entries up to date: entries no longer listed are
    forgotten, missing or due ones read (``force_files``: every file entry, after a push;
    ``force_feeds``: every feed, conditionally)."""
    now = time.time() if now is None else now
    rows = {f.url: f for f in await asyncio.to_thread(store.feeds_under, repo_prefix(repo))}
    wanted = {source_key(repo, e): e for e in dict.fromkeys(entries)}
    done: list[Synced] = []
    for key in (rows.keys() - wanted.keys()) if drop else ():
        await asyncio.to_thread(store.drop_feed, key)
        done.append(Synced(key[len(repo_prefix(repo)):], "changed"))
    for key, entry in wanted.items():
        row = rows.get(key)
        due = row is None or row.fetched_at + RECHECK_SECONDS <= now \
            or (force_feeds if is_feed(entry) else force_files)
        if due:
            done.append(await sync_entry(store, repo, entry, reader,
                                         private_feeds=private_feeds, stored=row))
    return done


def due_entries(rows: list[Feed], repo: str, entries: list[str], now: float, *,
                drop: bool = True) -> bool:
    """Whether ``sync_repo`` has anything to do (read in the same thread as the rows)."""
    have = {f.url: f for f in rows}
    wanted = {source_key(repo, e) for e in entries}
    if not wanted <= have.keys() or (drop and have.keys() != wanted):
        return True
    return any(have[key].fetched_at + RECHECK_SECONDS <= now for key in wanted)


# --- the App --------------------------------------------------------------------------------------

async def ensure(ctx: Context, config: RepoConfig) -> bool:
    """Bring this repository's ``clusters:`` up to date; True when the caller must take a new
    view of the index. Without ``repo_sources`` (tests, tools) nothing is read."""
    return (await _ensure(ctx, config, force_files=False))[0]


async def ensure_upstream(ctx: Context, upstream: str) -> None:
    """An allowed upstream's own ``clusters:``, read as its own issues would read them, with
    this delivery's credentials (the upstream rule has already said this installation may see
    it). Its config is cached as any repository's; a failure leaves what is stored."""
    if ctx.services.repo_sources is None:
        return
    other = Context(delivery_id=ctx.delivery_id, repo_name=upstream,
                    # Its class: a dry run without credentials reads nothing here either.
                    repo=type(ctx.repo)(ctx.repo.gh, upstream), services=ctx.services,
                    payload=ctx.payload, attempt=ctx.attempt)
    try:
        config = await other.repo_config()
        # What this installation reads of the upstream's config may be less than what the
        # upstream's own installation reads (a private owner's .github falling back): it adds
        # and refreshes, never removes what the upstream's own reads stored.
        if config.clusters:
            await _ensure(other, config, force_files=False, drop=False)
    except RepoConfigError:
        return  # its own config check reports it, where its maintainers look
    except (gidgethub.GitHubException, aiohttp.ClientError, OSError, TimeoutError) as exc:
        log.info("delivery %s: upstream %s: clusters: not read (%s)", ctx.delivery_id,
                 upstream, type(exc).__name__)


async def _ensure(ctx: Context, config: RepoConfig, *, force_files: bool, drop: bool = True
                  ) -> tuple[bool, list[Synced]]:
    sources = ctx.services.repo_sources
    if sources is None:
        return False, []
    repo = ctx.repo_name
    entries = list(config.clusters)
    marker = (repo.lower(), tuple(entries), drop)
    if not force_files and marker in sources.checked:
        return False, []
    store = ctx.services.store
    async with ctx.services.fetch_lock(f"repo-clusters:{repo.lower()}"):
        if not force_files and marker in sources.checked:
            # Brought up to date (and indexed) while this delivery waited: its early view
            # may predate that.
            return True, []
        now = time.time()
        rows = await asyncio.to_thread(store.feeds_under, repo_prefix(repo))
        if not rows and not entries:
            sources.checked[marker] = True  # nothing listed, nothing stored: most repositories
            return False, []
        if not force_files and not due_entries(rows, repo, entries, now, drop=drop):
            # Up to date in the store, perhaps stored by another process whose notification
            # is still being applied here: the files written now if they are not yet, and the
            # index brought to them. The caller takes a new view: the one taken before may
            # predate them.
            await sources.bring(repo)
            sources.checked[marker] = True
            return True, []
        done = await sync_repo(store, repo, entries, ContentsReader(ctx.repo),
                               private_feeds=sources.private_feeds, force_files=force_files,
                               now=now, drop=drop)
        for synced in done:
            _log(ctx, synced)
        changed = any(s.outcome == "changed" for s in done)
        if changed:
            # Indexed before the mark is set: a delivery that waited here finds it in use.
            await sources.refresh(changed=True)
        if not any(s.outcome == "failed" for s in done):
            sources.checked[marker] = True
    return changed, done


def _log(ctx: Context, synced: Synced) -> None:
    if synced.outcome == "failed":
        log.warning("delivery %s: %s clusters: %s: %s; its last good version stays",
                    ctx.delivery_id, ctx.repo_name, shown_entry(synced.entry), synced.error)
        return
    if synced.outcome == "changed":
        log.info("delivery %s: %s clusters: %s: %d cluster(s)", ctx.delivery_id,
                 ctx.repo_name, shown_entry(synced.entry), synced.clusters)
    for problem in synced.problems[:20]:
        log.warning("delivery %s: %s clusters: %s", ctx.delivery_id, ctx.repo_name, problem)
    if len(synced.problems) > 20:
        log.warning("delivery %s: %s clusters: %d more problem(s)", ctx.delivery_id,
                    ctx.repo_name, len(synced.problems) - 20)


def shown_entry(entry: str) -> str:
    return shown(entry) if is_feed(entry) else entry


def push_touches(data: dict[str, Any], entries: list[str]) -> bool:
    """Whether a push may have changed a file under one of ``entries`` (or the config file,
    which may change the list). Unknown means yes, as for the config."""
    if push_changes_config(data):
        return True
    return touches((path for commit in data.get("commits") or []
                    for kind in ("added", "modified", "removed")
                    for path in commit.get(kind) or []), entries)


def touches(paths: Iterable[object], entries: list[str]) -> bool:
    """Whether one of ``paths`` is a file entry or lies under one."""
    roots = [e for e in entries if not is_feed(e)]
    return any(isinstance(path, str) and (path == root or path.startswith(root + "/"))
               for path in paths for root in roots)


@router.register("push")
async def on_push(event: Event, ctx: Context) -> None:
    data = event.data
    repo = data.get("repository")
    default = repo.get("default_branch") if isinstance(repo, dict) else None
    if ctx.services.repo_sources is None or not isinstance(default, str) \
            or data.get("ref") != f"refs/heads/{default}":
        return
    if push_changes_config(data):
        # The config check's handler drops it as well; this one must not read the old list.
        ctx.services.forget_repo_config(ctx.repo_name)
    try:
        config = await ctx.repo_config()
    except RepoConfigError:
        return  # the config check reports it; the last good versions stay meanwhile
    stored = await asyncio.to_thread(ctx.services.store.feeds_under, repo_prefix(ctx.repo_name))
    if not config.clusters and not stored:
        return
    entries = list(config.clusters)
    if push_touches(data, entries) or {f.url for f in stored} != {
            source_key(ctx.repo_name, e) for e in entries}:
        _, done = await _ensure(ctx, config, force_files=True)
        sha = commit_sha(data.get("after"))
        if entries and sha is not None and not data.get("deleted") and set(sha) != {"0"}:
            await post_check(ctx, sha, CHECK_NAME, *build_check(ctx, sha, done))


def build_check(ctx: Context, sha: str, done: list[Synced], *, stored: bool = True
                ) -> tuple[str, str, str, list[dict[str, Any]]]:
    """(conclusion, title, summary, annotations) for the ``clusters:`` read at ``sha``: the
    maintainers see a bad line on its file and line, as the config's own problems, without
    the operator's log. ``failure`` when something was left out."""
    problems = [(s.entry, p) for s in done for p in s.problems]
    failed = [s for s in done if s.outcome == "failed"]
    kept = sum(s.clusters for s in done)
    lines = [f"- `{shown_entry(s.entry)}`: {s.clusters} cluster(s)"
             + (f"; not read now ({s.error})"
                + (", its last good version stays" if stored else "") if s.error else "")
             for s in done]
    annotations: list[dict[str, Any]] = []
    for entry, problem in problems:
        where = f"`{shown_entry(problem.path)}`" + (f" line {problem.line}"
                                                     if problem.line else "")
        lines.append(f"- {where}: {problem.field + ': ' if problem.field else ''}"
                     f"{problem.message}")
        if is_feed(entry) or (problem.path == entry and not problem.line):
            continue  # a feed's line, or an entry not found: no file of this commit to mark
        annotations.append({
            "path": problem.path, "start_line": problem.line or 1,
            "end_line": problem.line or 1,
            "annotation_level": "failure" if problem.level == "error" else "warning",
            "title": problem.field or CHECK_NAME, "message": problem.message})
    errors = [p for _, p in problems if p.level == "error"]
    if errors or failed:
        conclusion = "failure" if errors else "neutral"
        usable = f"{kept} cluster(s) {'in use' if stored else 'usable'}"
        title = (f"{len(errors)} problem(s) in the clusters: files; {usable}"
                 if errors else f"{len(failed)} source(s) not read now; {usable}")
    else:
        conclusion, title = "success", f"{kept} known bug(s) from clusters:"
    summary = "Known bugs listed under `clusters:` in `.github/dejafix.yml`:\n\n" + \
        "\n".join(lines[:200])
    return conclusion, title, summary, annotations[:50]


@router.register("installation", action="deleted")
@router.register("installation_repositories", action="removed")
async def on_removed(event: Event, ctx: Context) -> None:
    """A repository the App no longer sees takes its own clusters with it: nothing would read
    them again, and the index would keep them."""
    sources = ctx.services.repo_sources
    key = "repositories" if event.event == "installation" else "repositories_removed"
    repos = installed_repos(event.data, key)
    if sources is None or not repos:
        return
    store = ctx.services.store

    def drop() -> int:
        return sum(store.drop_feed(row.url) for repo in repos
                   for row in store.feeds_under(repo_prefix(repo)))

    dropped = await asyncio.to_thread(drop)
    if dropped:
        await sources.refresh(changed=True)
        log.info("delivery %s: %d repositories removed; the stored clusters: of %d source(s) "
                 "dropped", ctx.delivery_id, len(repos), dropped)


@router.register("pull_request", action="opened")
@router.register("pull_request", action="synchronize")
@router.register("pull_request", action="reopened")
async def on_pull_request(event: Event, ctx: Context) -> None:
    """A pull request changing the ``clusters:`` files (or the list) gets the known-bugs check
    on its head commit before it is merged: the files as they are there, nothing stored."""
    pr = event.data.get("pull_request")
    head = pr.get("head") if isinstance(pr, dict) else None
    sha = commit_sha(head.get("sha")) if isinstance(head, dict) else None
    number = event.data.get("number")
    if ctx.services.repo_sources is None or sha is None or not isinstance(number, int):
        return
    # Only where the default branch lists some already: no call at all for the repositories
    # that keep none (a pull request adding the first is checked once merged).
    try:
        listed = [e for e in (await ctx.repo_config()).clusters if not is_feed(e)]
    except RepoConfigError:
        return
    if not listed:
        return
    changed = [str(f.get("filename")) for f in await ctx.repo.pr_files(number)
               if isinstance(f, dict)]
    entries = listed
    if CONFIG_PATH in changed:
        # The list itself may change: as the head has it (the config check reports a bad file).
        text = await ctx.repo.read_file_from(ctx.repo_name, CONFIG_PATH, sha)
        resolved = await resolve_config_text(ctx.repo, ctx.repo_name, text or "")
        if not isinstance(resolved.result, RepoConfig):
            return
        entries = [e for e in resolved.result.clusters if not is_feed(e)]
    elif not touches(changed, entries):
        return
    if not entries:
        return
    done = await check_files(ctx.repo_name, entries, ContentsReader(ctx.repo, sha))
    await post_check(ctx, sha, CHECK_NAME, *build_check(ctx, sha, done, stored=False))
