"""The intake's rounds written by a child process with its own SQLite connection.

Why a process: in the server, the intake's writer thread and the event loop share the GIL. A
round is a dozen SQLite statements, and every one of them lets go of the GIL and has to take it
back from the loop's thread, which is busy exactly when rounds are large; measured under load, a
round spent two thirds of its time waiting for the GIL, and the requests waiting for that round
waited with it. The child has its own GIL: a round costs the writer thread one send and one
receive on a socket, and the statements run on the other core while the loop parses the next
requests.

The child holds nothing that the database does not: if it dies, ``commit_round`` raises (the
intake then writes that round itself, statement by statement, as it does for any failed
round) and every later round is written in the parent's own thread. A round whose outcome
is unknown (the child died while writing it) is safe to write again: deliveries are recognised
by id, completions are idempotent, and a lease taken by a dead child is taken over after it
expires.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import sqlite3
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from bot.store import Claim, Delivery, Job, Store

log = logging.getLogger("dejafix.intake")

# Seconds to wait for the child to start and to leave.
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
# Seconds a round may take in the child before it is given up (the store's own lock timeout
# is 5 s; a round that takes this long is stuck, not slow).
ROUND_TIMEOUT = 30.0
# Seconds between the child's checkpoints.
CHECKPOINT_SECONDS = 0.25
# Log pages (4 kB) past which a checkpoint makes the log restart (Checkpointer): a RESTART
# holds the writers for its last copy and two fsyncs (tens of ms), so only every 128 MB of log
# under a steady stream of rounds. It waits at most RESTART_WAIT_MS for readers, and after
# one that found them holding on, the next RESTART_BACKOFF checkpoints are PASSIVE only.
RESTART_FRAMES = 32768
RESTART_WAIT_MS = 20
RESTART_BACKOFF = 4


class WriterGone(RuntimeError):
    """The child process is not there (any more): the round must be written another way."""


def spawn(target: Callable[..., None], args: tuple[Any, ...], name: str
          ) -> tuple[Connection, Connection, BaseProcess]:
    """A daemon child running ``target(its end of the socket, *args)``, not started yet, and
    the two ends of that socket (the caller closes the child's once it has started).
    forkserver: the child is forked from a clean server process, not from this one (which has
    threads), and after the first it starts in milliseconds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["bot.store"])
    parent, child = context.Pipe(duplex=True)
    process = context.Process(target=target, args=(child, *args), name=name, daemon=True)
    return parent, child, process


def open_child_store(conn: Connection, data_dir: str, max_attempts: int
                     ) -> tuple[Store, Checkpointer] | None:
    """In a child that writes the store: open it with a checkpointer thread beside it, and say
    "ready" to the parent (or "error" with why, and None)."""
    # A Ctrl-C or a service manager's SIGTERM goes to the whole process group: the parent
    # finishes its last writes and then tells this process to stop. Killed first, it would
    # leave them to the parent's slower path (or to the next start).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        store = Store(Path(data_dir), max_attempts=max_attempts, spin_on_busy=True)
        checkpointer = Checkpointer(store.path)
        # The commits no longer copy the log back into the database (and fsync it) every
        # thousand pages, which stalled every request waiting on that commit: the
        # checkpointer thread does it beside them.
        store.disable_autocheckpoint()
    except BaseException as exc:
        conn.send(("error", _portable(exc)))
        return None
    conn.send(("ready", None))
    return store, checkpointer


def _serve(conn: Connection, data_dir: str, max_attempts: int) -> None:
    """The child: open the store, then write each round it is sent, until told to stop or the
    parent goes away (its end of the socket closes)."""
    opened = open_child_store(conn, data_dir, max_attempts)
    if opened is None:
        return
    store, checkpointer = opened
    try:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                return
            if request is None:
                return
            deliveries, completed, claim = request
            try:
                accepted, done, jobs = store.commit_round(deliveries, completed, claim)
            except Exception as exc:
                conn.send(("error", _portable(exc)))
                continue
            # Bodies recorded in this round are in the parent's hands already: not sent back.
            fresh = {d[0] for d, new in zip(deliveries, accepted, strict=True) if new}
            conn.send(("ok", (accepted, done,
                              [(job if job.delivery_id not in fresh else _without_body(job),
                                job.delivery_id in fresh) for job in jobs])))
    finally:
        checkpointer.stop()
        store.close()


class Checkpointer:
    """Copies the write-ahead log back into the database every ``interval`` seconds, from its
    own connection and thread, so that the writer's commits never do it.

    A PASSIVE checkpoint neither waits for nor blocks anyone, but under a steady stream of
    rounds it never catches up with the last one, and the log only restarts from its beginning
    once a checkpoint has: it would grow by tens of MB a second. So when the log has grown past
    ``restart_frames`` pages, a RESTART checkpoint holds the writers back while it copies what the
    PASSIVE ones left and syncs the files (tens of ms on this machine's disk), and waits (at
    most ``RESTART_WAIT_MS``) for the readers to finish with the log, after which the next
    round writes it from the start again. At a steady few deliveries a second the PASSIVE
    checkpoints catch up between rounds and no RESTART is needed."""

    def __init__(self, db_path: Path, interval: float = CHECKPOINT_SECONDS,
                 restart_frames: int = RESTART_FRAMES) -> None:
        self._conn = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        self._conn.execute(f"PRAGMA busy_timeout = {RESTART_WAIT_MS}")
        self._stop = threading.Event()
        self._interval = interval
        self._restart_frames = restart_frames
        self._pause = 0  # checkpoints to skip the RESTART for, after one that found readers
        self._thread = threading.Thread(target=self._run, name="dejafix-checkpoint",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.checkpoint()
        self.checkpoint()
        self._conn.close()

    def checkpoint(self) -> tuple[int, int, int] | None:
        """(busy, pages in the log, pages copied) of the last checkpoint run; None if none
        could run."""
        try:
            row = self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if row[1] > self._restart_frames and self._pause == 0:
                row = self._conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
                if row[0]:  # readers held on: leave the writers alone for a while
                    self._pause = RESTART_BACKOFF
            elif self._pause:
                self._pause -= 1
        except sqlite3.Error as exc:  # the next one tries again; the log only grows meanwhile
            log.warning("intake: checkpoint failed: %s", exc)
            return None
        return int(row[0]), int(row[1]), int(row[2])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(STOP_TIMEOUT)


def _without_body(job: Job) -> Job:
    return Job(job.id, job.delivery_id, job.event, job.action, job.repo, job.installation_id,
               b"", job.attempts)


def _portable(exc: BaseException) -> Exception:
    """The exception as the parent can unpickle it: sqlite3's errors are, others may not be."""
    try:
        import pickle

        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))


class RoundWriter:
    """``commit_round`` with the same arguments and results as ``Store.commit_round``, written by
    the child process. Called from one thread at a time (the intake's writer thread)."""

    def __init__(self, data_dir: Path, max_attempts: int) -> None:
        self._conn, child, self._process = spawn(_serve, (str(data_dir), max_attempts),
                                                 "dejafix-writer")
        self._lock = threading.Lock()
        self._gone = False
        try:
            self._process.start()
            child.close()
            kind, error = self._receive(START_TIMEOUT)
            if kind != "ready":
                raise WriterGone(f"the writer process could not open the store: {error}")
        except BaseException:
            child.close()
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return not self._gone

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _receive(self, timeout: float) -> tuple[str, Any]:
        try:
            if not self._conn.poll(timeout):
                # Alive but stuck (a hung disk, a stopped process): its requests must not wait
                # for ever; the caller writes the round another way.
                self._gone = True
                if self._process.pid is not None:
                    self._process.kill()
                raise WriterGone(f"the writer process did not answer in {timeout:g} s")
            message: tuple[str, Any] = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._gone = True
            raise WriterGone(f"the writer process went away ({exc or 'closed'})") from exc
        return message

    def commit_round(self, deliveries: list[Delivery], completed: list[int],
                     claim: Claim | None) -> tuple[list[bool], list[bool], list[Job]]:
        with self._lock:
            if self._gone:
                raise WriterGone("the writer process is gone")
            try:
                self._conn.send((deliveries, completed, claim))
            except OSError as exc:
                self._gone = True
                raise WriterGone(f"the writer process went away ({exc})") from exc
            kind, result = self._receive(ROUND_TIMEOUT)
        if kind == "error":
            raise result
        accepted, done, jobs = result
        # A job leased for a delivery recorded in this round gets the very body object it was
        # given (the intake pairs it with its parsed payload by identity), as Store.commit_round
        # does; the first delivery under an id is the one recorded.
        bodies: dict[str, bytes] = {}
        for delivery, new in zip(deliveries, accepted, strict=True):
            if new:
                bodies.setdefault(delivery[0], delivery[5])
        return accepted, done, [
            Job(job.id, job.delivery_id, job.event, job.action, job.repo, job.installation_id,
                bodies[job.delivery_id], job.attempts) if recorded_here else job
            for job, recorded_here in jobs]

    def close(self) -> None:
        with self._lock:
            if not self._gone:
                with contextlib.suppress(OSError):
                    self._conn.send(None)
            self._gone = True
            self._conn.close()
        if self._process.pid is None:  # never started
            return
        self._process.join(STOP_TIMEOUT)
        if self._process.is_alive():
            log.warning("intake: the writer process did not stop; killed")
            self._process.kill()
            self._process.join()
