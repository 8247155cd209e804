"""Group commit for the receiver: deliveries that arrive while a commit is in progress are
written together in the next one. Each request still gets its 202 only after its delivery is
durably in SQLite; under load, one thread hop and one commit serve many requests."""

from __future__ import annotations

import asyncio
import logging

from bot.store import Store

log = logging.getLogger("dejafix.intake")

Delivery = tuple[str, str, str | None, str | None, int | None, bytes]


class Intake:
    def __init__(self, store: Store, max_batch: int = 256) -> None:
        self.store = store
        self.max_batch = max_batch
        self._pending: list[tuple[Delivery, asyncio.Future[bool]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def accept(self, delivery: Delivery) -> bool:
        """True if the delivery is new (now recorded with its job), False for a redelivery."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((delivery, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        # shield: a client that hangs up must not cancel the commit others wait on.
        return await asyncio.shield(future)

    async def _write(self) -> None:
        while self._pending:
            batch = self._pending[: self.max_batch]
            del self._pending[: self.max_batch]
            try:
                results = await asyncio.to_thread(self.store.accept_deliveries,
                                                  [d for d, _ in batch])
            except Exception:
                # One bad row must not fail the others: write them one by one.
                log.warning("intake: batch of %d failed; writing one by one", len(batch))
                results = []
                for delivery, future in batch:
                    try:
                        results.append(await asyncio.to_thread(self.store.accept_delivery,
                                                               *delivery))
                    except Exception as exc:
                        results.append(False)
                        if not future.done():
                            future.set_exception(exc)
            for (_, future), fresh in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(fresh)
