"""Command line: ``serve`` (the web process), ``match`` and ``eval`` (offline, no network)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bot import __version__


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from bot.app import create_app
    from bot.settings import Settings, SettingsError, load_service_config

    log = logging.getLogger("dejafix")
    try:
        settings = Settings.from_env()
        config = load_service_config(Path(args.config) if args.config else None)
        dry_run = args.dry_run
        if not dry_run and not settings.has_app_credentials:
            raise SettingsError(
                "DEJAFIX_APP_ID and DEJAFIX_PRIVATE_KEY (or _PATH) are required to post; "
                "use --dry-run to run without them"
            )
        app = create_app(settings, config, dry_run=dry_run)
    except SettingsError as exc:
        log.error("cannot start: %s", exc)
        return 2
    port = args.port or settings.port
    host = args.host
    if host is None:
        # Unsigned deliveries are accepted only in dry-run without a secret: keep that local.
        host = "0.0.0.0" if settings.webhook_secret is not None else "127.0.0.1"
    log.info("listening on http://%s:%s", host, port)
    web.run_app(app, host=host, port=port, print=None, access_log=None)
    return 0


def build_parser() -> argparse.ArgumentParser:
    import bot.offline as offline

    parser = argparse.ArgumentParser(prog="python -m bot", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dejafix {__version__}")
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the webhook receiver and worker")
    serve.add_argument("--dry-run", action="store_true",
                       help="post nothing to GitHub; log the comment that would be posted")
    serve.add_argument("--host", default=None,
                       help="default: 0.0.0.0 with a webhook secret, else 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default: $PORT or 8000")
    serve.add_argument("--config", default=None, help="service config (default config/bot.yml)")
    serve.set_defaults(func=_serve)

    match = sub.add_parser("match", help="match issues (JSON Lines) against clusters, offline")
    offline.add_match_arguments(match)
    match.set_defaults(func=offline.run_match)

    evaluate = sub.add_parser("eval", help="measure matching on labelled issues")
    offline.add_eval_arguments(evaluate)
    evaluate.set_defaults(func=offline.run_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
