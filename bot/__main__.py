"""Command line: ``serve`` (the receiver, and a worker unless ``--no-worker``), ``worker`` (jobs
only), ``match`` and ``eval`` (offline, no network), ``backfill`` and ``backtest``, ``config
check`` (validate a ``.github/dejafix.yml``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from bot import __version__

LOG_FORMATS = ("text", "json")
# Allocations between young-generation collections in the server (Python's default: 700).
GC_YOUNG_THRESHOLD = 10_000


def _configure_logging(level: str, log_format: str | None = None) -> None:
    """Text lines by default; with ``json`` (``--log-format``, else ``DEJAFIX_LOG_FORMAT``) one
    JSON object per line, with the delivery, repo and issue it concerns when known."""

    chosen = (log_format or os.environ.get("DEJAFIX_LOG_FORMAT") or "text").strip().lower()
    handler = logging.StreamHandler(sys.stderr)
    if chosen == "json":
        from bot.logs import ContextFilter, json_formatter

        handler.addFilter(ContextFilter())
        handler.setFormatter(json_formatter())
    else:
        from bot.logs import text_formatter

        handler.setFormatter(text_formatter())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
    if chosen not in LOG_FORMATS:
        logging.getLogger("dejafix").warning(
            "DEJAFIX_LOG_FORMAT=%r is not one of %s; using text", chosen[:20],
            ", ".join(LOG_FORMATS))


async def _settle_heap(app: object) -> None:
    """What start-up allocated (modules, the index, the services) lives as long as the process:
    frozen out of the collector's generations, it is no longer walked by each full collection
    (tens of ms on the event loop while requests wait). The young generation collects less
    often: a delivery's parsed payload is freed by reference counting, and collecting every 700
    allocations found little else. Process-wide, so here and not in create_app (tests)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _serve(args: argparse.Namespace, *, receive: bool = True) -> int:
    """``serve``: the receiver and, unless ``--no-worker``, a worker; ``worker``: jobs only."""
    import asyncio

    from bot.db.sqlite import DataDirInUse, lock_data_dir
    from bot.settings import Settings, SettingsError, load_service_config
    from bot.web.app import create_app

    log = logging.getLogger("dejafix")
    work = not getattr(args, "no_worker", False)
    try:
        settings = Settings.from_env()
        if args.config and not Path(args.config).is_file():
            raise SettingsError(f"--config {args.config}: no such file")
        config = load_service_config(Path(args.config) if args.config else None)
        _check_data_dir(settings.data_dir)
        dry_run = args.dry_run
        if not dry_run and not settings.has_app_credentials:
            raise SettingsError(
                "DEJAFIX_APP_ID and DEJAFIX_PRIVATE_KEY (or _PATH) are required to post; "
                "use --dry-run to run without them"
            )
        if not receive and not work:
            raise SettingsError("a worker with --no-worker would do nothing")
        app = create_app(settings, config, dry_run=dry_run, receive=receive, work=work)
        # SQLite: held until the process ends, one worker per data directory (it requeues at
        # start every job left running). PostgreSQL needs none: leases.
        data_lock = (lock_data_dir(settings.data_dir)  # noqa: F841
                     if work and settings.database_url is None else None)
    except (SettingsError, DataDirInUse) as exc:
        log.error("cannot start: %s", exc)
        return 2
    port = args.port if args.port is not None else (settings.port if receive else None)
    # Loopback unless the operator names another address (--host): the page is the operator's
    # and GitHub reaches the webhook through the proxy or tunnel in front.
    host = args.host or "127.0.0.1"
    # Appended after create_app's cleanup context: runs once the services have started.
    app.on_startup.append(_settle_heap)
    try:
        asyncio.run(_run(app, config, host, port))
    except Exception as exc:  # start-up failed (the store unreachable, the port taken)
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        return 2
    return 0


def _check_data_dir(data_dir: Path) -> None:
    """The data directory exists (or is made) and takes files: else an error naming the
    variable, before anything starts."""
    import tempfile

    from bot.settings import SettingsError

    if data_dir.exists() and not data_dir.is_dir():
        raise SettingsError(f"DEJAFIX_DATA_DIR ({data_dir}) is not a directory")
    try:
        # Owner-only: it holds the queue's payloads, the App's credentials and the operator
        # token.
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _tighten_data_dir(data_dir)
        with tempfile.TemporaryFile(dir=data_dir):
            pass
    except OSError as exc:
        raise SettingsError(f"DEJAFIX_DATA_DIR ({data_dir}) cannot be used: "
                            f"{exc.strerror or exc}") from None


def _tighten_data_dir(data_dir: Path) -> None:
    """mkdir's mode only applies to a directory it makes: one found there is checked. Nobody
    outside the owner and group 0 may use it: group 0 is how the container image shares /data
    with an arbitrary uid (owner 10001:0, mode 0770, OpenShift's random uid in group 0), and its
    members are root's peers anyway. Ours, open to others, is tightened with a warning; another
    user's is refused unless it is that shared volume."""
    import stat

    from bot.settings import SettingsError

    found = data_dir.stat()
    mode = stat.S_IMODE(found.st_mode)
    shared = found.st_gid == 0
    if found.st_uid != os.getuid():
        if not (shared and os.getgid() == 0 and mode & 0o070 == 0o070 and not mode & 0o007):
            raise SettingsError(
                f"DEJAFIX_DATA_DIR ({data_dir}) belongs to another user (uid {found.st_uid}): "
                "use a directory of the user Dejafix runs as (or, in a container, group 0's "
                "with mode 0770)")
        return
    others = 0o007 if shared else 0o077
    if mode & others:
        os.chmod(data_dir, mode & ~others)
        logging.getLogger("dejafix").warning(
            "DEJAFIX_DATA_DIR (%s) was open to other users (mode %03o): made %03o; it holds "
            "the App's credentials and the operator token", data_dir, mode, mode & ~others)


def operator_link(host: str, port: int, token: str) -> str:
    """The page's address on this machine, with the operator token to exchange for a session."""
    from urllib.parse import quote

    if host in ("", "0.0.0.0", "::", "127.0.0.1", "localhost"):
        where = "127.0.0.1"
    else:
        where = f"[{host}]" if ":" in host else host
    return f"http://{where}:{port}/?token={quote(token, safe='')}"


async def _run(app: object, config: object, host: str, port: int | None) -> None:
    """Serve until SIGTERM or SIGINT, then drain while still accepting deliveries
    (``bot.web.app.drain``), then close. aiohttp's ``run_app`` would stop accepting first."""
    import asyncio
    import signal

    from aiohttp import web

    from bot.settings import ServiceConfig
    from bot.web.app import drain, server_runner
    from bot.web.auth import OPERATOR

    assert isinstance(app, web.Application) and isinstance(config, ServiceConfig)
    log = logging.getLogger("dejafix")
    runner = server_runner(app)
    await runner.setup()
    try:
        if port is not None:
            site = web.TCPSite(runner, host, port)
            await site.start()
            # The port bound (a given 0 picks a free one).
            port = next((a[1] for a in runner.addresses if isinstance(a, tuple)), port)
            log.info("listening on http://%s:%s", host, port)
            operator = app.get(OPERATOR)
            if operator is not None:
                # The one line that holds the token: the operator's way in (README, "The web
                # page"). Deleting the file in the data directory rotates it at next start.
                log.info("operator link: %s", operator_link(host, port, operator.token))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await drain(app, config)
    finally:
        await runner.cleanup()


async def _backfill_async(args: argparse.Namespace) -> int:
    import aiohttp

    from bot.cli_progress import BackfillView
    from bot.db import open_store
    from bot.features.backfill import Backfill
    from bot.github.app import GitHubApp
    from bot.github.client import USER_AGENT, RepoClient, RetryingGitHubAPI
    from bot.settings import Settings

    settings = Settings.from_env()
    store = open_store(settings.data_dir, _database_url(settings))
    try:
        async with aiohttp.ClientSession() as session:
            token = os.environ.get("DEJAFIX_GITHUB_TOKEN", "").strip() or None
            if token is not None:
                gh = RetryingGitHubAPI(session, USER_AGENT, oauth_token=token,
                                       base_url=settings.github_url)
            elif settings.has_app_credentials:
                app = GitHubApp(session, base_url=settings.github_url, app_id=settings.app_id,
                                private_key=settings.private_key)
                gh = await app.for_installation(await app.installation_for(args.repo))
            else:
                print("backfill needs DEJAFIX_GITHUB_TOKEN, or the App's DEJAFIX_APP_ID and "
                      "DEJAFIX_PRIVATE_KEY(_PATH)", file=sys.stderr)
                return 2
            # The bar (a terminal) or the plain lines go to stderr; the summary to stdout.
            with BackfillView(sys.stderr) as view:
                run = Backfill(RepoClient(gh, args.repo), store, args.repo, since=args.since,
                               diffs=not args.no_diffs, progress=view)
                summary = await run.run()
    finally:
        store.close()
    for line in summary.lines():
        print(line)
    return 0


def _backfill(args: argparse.Namespace) -> int:
    import asyncio

    import aiohttp
    import gidgethub

    from bot.settings import SettingsError

    try:
        return asyncio.run(_backfill_async(args))
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume", file=sys.stderr)
        return 130
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        print(f"backfill {args.repo}: cannot reach GitHub ({type(exc).__name__}: {exc}); run "
              "the same command again to resume", file=sys.stderr)
        return 1
    except gidgethub.GitHubException as exc:
        status = getattr(exc, "status_code", None)
        print(f"backfill {args.repo}: GitHub answered {int(status) if status else ''} "
              f"{exc}".replace("  ", " "), file=sys.stderr)
        return 1
    except SettingsError as exc:
        print(f"backfill: {exc}", file=sys.stderr)
        return 2


def _backtest(args: argparse.Namespace) -> int:
    from bot.clusters.load import load_clusters
    from bot.db import open_store
    from bot.eval.backtest import history_queries, recommend_threshold, replay
    from bot.eval.offline import pr_at, pr_curve, print_pr_table, write_plot
    from bot.matching import MatchPolicy
    from bot.settings import Settings

    if args.clusters:
        clusters = [c for c in load_clusters(args.clusters).clusters
                    if c.repo.lower() == args.repo.lower()]
    else:
        settings = Settings.from_env()
        store = open_store(settings.data_dir, _database_url(settings))
        clusters = store.learned_clusters(args.repo)
        store.close()
    queries = history_queries(clusters)
    if not queries:
        print(f"{args.repo}: no issues with opening dates among {len(clusters)} clusters "
              "(a cluster file's issue members need `created_at`); learn the repository's "
              "history first with `.venv/bin/dejafix backfill OWNER/REPO`", file=sys.stderr)
        return 1
    policy = MatchPolicy()
    outcomes = replay(clusters, policy, queries)
    positives = sum(1 for o in outcomes if o.expected)
    said, right, precision, recall = pr_at(outcomes, policy.threshold, policy.margin)
    print(f"{args.repo}: {len(clusters)} clusters, {len(outcomes)} issues replayed "
          f"({positives} opened after their bug's fix, {len(outcomes) - positives} before)")
    print(f"at the default threshold {policy.threshold:.2f}: comments {said}, right {right}: "
          f"precision {precision:.3f} recall {recall:.3f}")
    print_pr_table(outcomes, policy.margin)
    best = recommend_threshold(outcomes, args.precision)
    if best is None:
        print(f"no threshold reaches precision {args.precision:.2f} on this history")
    else:
        print(f"recommended threshold for precision >= {args.precision:.2f}: {best[0]:.2f} "
              f"(precision {best[1]:.3f}, recall {best[2]:.3f}); set `threshold:` in "
              ".github/dejafix.yml")
    if args.plot and write_plot(args.plot, {"backtest": pr_curve(outcomes)},
                                (precision, recall)):
        print(f"plot written to {args.plot}")
    return 0


def _config_check(args: argparse.Namespace) -> int:
    from bot.repo_config import RepoConfigError, read_config_file

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{path}: cannot read ({exc})", file=sys.stderr)
        return 2
    try:
        parsed = read_config_file(text, source=str(path))
    except RepoConfigError as exc:
        for line in exc.lines():
            print(line)
        return 1
    if parsed.extends is not None:
        print(f"{path}:{parsed.extends_line}: _extends: {parsed.extends} is not read offline; "
              "the bot merges it underneath this file", file=sys.stderr)
    print(f"{path}: valid")
    return 0


def _action(args: argparse.Namespace) -> int:
    from bot.action import run_action

    return run_action()


def _repo_name(text: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not OWNER/REPO")
    return text


def _date(text: str) -> str:
    """A date (or an ISO 8601 time) as GitHub compares them: ISO text."""
    from datetime import datetime

    try:
        datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date (YYYY-MM-DD)") from None
    return text


def _database_url(settings: object) -> str | None:
    url = getattr(settings, "database_url", None)
    return url.get_secret_value() if url is not None else None


def build_parser() -> argparse.ArgumentParser:
    import bot.eval.offline as offline

    parser = argparse.ArgumentParser(prog="python -m bot", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dejafix {__version__}")
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=("debug", "info", "warning", "error", "critical"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the webhook receiver and worker")
    serve.add_argument("--dry-run", action="store_true",
                       help="post nothing to GitHub; log the comment that would be posted")
    serve.add_argument("--host", default=None,
                       help="address to listen on (default: 127.0.0.1; a container or a "
                            "platform that routes to the process needs 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None, help="default: $PORT or 8000")
    serve.add_argument("--no-worker", action="store_true",
                       help="receive only; `python -m bot worker` processes run the jobs "
                            "(PostgreSQL, or one worker on the same SQLite data directory)")
    serve.add_argument("--config", default=None, help="service config (default config/bot.yml)")
    serve.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                       help="text (default) or json: one object per line with the delivery, "
                            "repo and issue (also $DEJAFIX_LOG_FORMAT)")
    serve.set_defaults(func=_serve)

    worker = sub.add_parser("worker", help="run jobs only (no webhook receiver)")
    worker.add_argument("--dry-run", action="store_true",
                        help="post nothing to GitHub; log the comment that would be posted")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=None,
                        help="serve /healthz and /metrics on this port (default: none)")
    worker.add_argument("--config", default=None, help="service config (default config/bot.yml)")
    worker.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        help="text (default) or json (also $DEJAFIX_LOG_FORMAT)")
    worker.set_defaults(func=lambda args: _serve(args, receive=False))

    match = sub.add_parser("match", help="match issues (JSON Lines) against clusters, offline")
    offline.add_match_arguments(match)
    match.set_defaults(func=offline.run_match)

    evaluate = sub.add_parser("eval", help="measure matching on labelled issues")
    offline.add_eval_arguments(evaluate)
    evaluate.set_defaults(func=offline.run_eval)

    backfill = sub.add_parser("backfill", help="learn clusters from a repository's history")
    backfill.add_argument("repo", metavar="OWNER/REPO", type=_repo_name)
    backfill.add_argument("--since", default=None, type=_date,
                          help="only fixes merged on or after DATE (YYYY-MM-DD)")
    backfill.add_argument("--no-diffs", action="store_true",
                          help="learn the clusters with their fixes' paths only, without the "
                               "diffs phase (one REST call per fix; a later run without this "
                               "flag adds them)")
    backfill.set_defaults(func=_backfill)

    backtest = sub.add_parser("backtest", help="replay a repository's history against the bot")
    backtest.add_argument("repo", metavar="OWNER/REPO")
    backtest.add_argument("--clusters", action="append", default=None,
                          help="cluster files instead of the learned clusters in the store")
    backtest.add_argument("--precision", type=float, default=0.9,
                          help="wanted precision for the recommended threshold")
    backtest.add_argument("--plot", default=None, help="write a precision-recall PNG here")
    backtest.set_defaults(func=_backtest)

    config = sub.add_parser("config", help="work with .github/dejafix.yml")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check", help="validate a .github/dejafix.yml: file:line: key: message per error, "
                      "exit 1 on errors")
    check.add_argument("file", metavar="FILE")
    check.set_defaults(func=_config_check)

    action = sub.add_parser(
        "action", help="run as a step of a GitHub Actions workflow (action.yml): the event "
                       "from GITHUB_EVENT_PATH, the token from INPUT_TOKEN or GITHUB_TOKEN")
    action.set_defaults(func=_action)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.log_level, getattr(args, "log_format", None))
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
