"""Crash-test child: accept a delivery, claim its job, then die before finishing it.

Run as ``python tests/store_crash_child.py TARGET DELIVERY_ID LEASE_SECONDS [start]``. TARGET is
a data directory (SQLite) or a ``postgresql://`` URL (PostgreSQL). With ``start`` the child also
counts the run's attempt (``start_job``) before it dies; without, it dies between the claim and
the start. It prints the job it held as JSON on stdout (so that the parent can check what was in
flight) and then SIGKILLs itself: no ``finally``, no atexit, no ``Store.close()``, exactly like a
process killed by the OOM killer or a deploy.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from bot.db.store import Store


def open_target(target: str) -> Store:
    if target.startswith(("postgresql://", "postgres://")):
        from bot.db.postgres import PostgresStore

        return PostgresStore(target)
    from bot.db.sqlite import SQLiteStore

    return SQLiteStore(Path(target))


def main() -> None:
    target, delivery_id, lease = sys.argv[1], sys.argv[2], float(sys.argv[3])
    start = sys.argv[4:] == ["start"]
    store = open_target(target)
    if not store.accept_delivery(delivery_id, "issues", "opened", "Acme/Widgets", 7,
                                 b'{"n": 1}', "acme/widgets#1"):
        sys.exit("delivery was already recorded")
    jobs = store.claim_jobs(lease, 1)
    if len(jobs) != 1:
        sys.exit(f"expected one job to claim, got {len(jobs)}")
    job = jobs[0]
    attempts = store.start_job(job.id) if start else job.attempts
    print(json.dumps({"id": job.id, "delivery_id": job.delivery_id, "attempts": attempts}),
          flush=True)
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)  # platforms without SIGKILL: still skips every cleanup handler


if __name__ == "__main__":
    main()
