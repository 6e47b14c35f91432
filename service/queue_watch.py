"""Waiting for an admission slot while listening for the client to leave.

A request queued for an engine slot has no handler yet, so nothing notices when its client
disconnects: it would keep its queue place, then take an engine slot and start a generation for
nobody, until vLLM's handler saw the disconnect. Under a disconnect storm that turns into 429s for
clients that are still there. While a request waits, ``acquire_unless_disconnected`` therefore
also waits on the server's ``receive``: an ``http.disconnect`` gives the place up at once. Any
other message read meanwhile (none is expected: the body was read whole before admission) is
handed to the app first, so nothing is lost.
"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive


def replaying(held: list[Message], receive: Receive) -> Receive:
    """``receive`` that returns ``held`` first, then the server's messages."""

    async def replay() -> Message:
        return held.pop(0) if held else await receive()

    return replay


def _give_back(acquire: asyncio.Future, slots: asyncio.Semaphore) -> None:
    if not acquire.cancel() and not acquire.cancelled() and acquire.exception() is None:
        slots.release()  # acquired just as we gave up: return the slot


async def acquire_unless_disconnected(slots: asyncio.Semaphore, receive: Receive) -> tuple[bool, Receive]:
    """Take a slot of ``slots``; ``(False, receive)`` if the client disconnected first (no slot
    held), else ``(True, receive for the app)``."""
    if not slots.locked():
        await slots.acquire()
        return True, receive
    held: list[Message] = []
    acquire = asyncio.ensure_future(slots.acquire())
    listen: asyncio.Future | None = None
    try:
        while True:
            listen = asyncio.ensure_future(receive())
            await asyncio.wait({acquire, listen}, return_when=asyncio.FIRST_COMPLETED)
            if not listen.done():
                listen.cancel()
                await asyncio.wait({listen})  # does not raise; the result is kept if it came first
            if not listen.cancelled():
                message = listen.result()
                if message["type"] == "http.disconnect":
                    _give_back(acquire, slots)
                    return False, receive
                held.append(message)
            if acquire.done():
                return True, replaying(held, receive)
    except BaseException:
        if listen is not None:
            listen.cancel()
        _give_back(acquire, slots)
        raise
