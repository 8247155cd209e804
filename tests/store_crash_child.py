"""Crash-test child: accept a delivery, claim its job, then die before completing it.

Run as ``python tests/store_crash_child.py DATA_DIR DELIVERY_ID``. Prints the claimed job as JSON
on stdout (so the parent can check what was in flight) and then SIGKILLs itself: no ``finally``,
no atexit, no ``Store.close()``, exactly like a process killed by the OOM killer or a deploy.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from bot.db.sqlite import Store


def main() -> None:
    data_dir, delivery_id = Path(sys.argv[1]), sys.argv[2]
    store = Store(data_dir)
    if not store.accept_delivery(delivery_id, "issues", "opened", "Owner/Repo", 7, b'{"n": 1}'):
        sys.exit("delivery was already recorded")
    job = store.claim_job(lease_seconds=3600)
    if job is None:
        sys.exit("nothing to claim")
    print(json.dumps({"id": job.id, "attempts": job.attempts}), flush=True)
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)  # platforms without SIGKILL: still skips every cleanup handler


if __name__ == "__main__":
    main()
