"""The outbox: one writer per connection, sending a session's events to the client in order.

Control events go out at once; a reply's events keep their order and its audio is paced at real
time (``output_lead_ms`` ahead of playback); deltas of a cancelled reply are dropped unsent, so
barge-in's ``ResponseFinished`` goes out ahead of any paced audio. A held reply (a speculative
answer) waits at the head of its lane until it is released; every event of a discarded one is
dropped unsent. The writer outlives any
failure of a single send (it is logged), so ``sync()`` always returns once the client reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from assistant.events import ResponseAudioDelta, ResponseFinished, ResponseStarted, ResponseTextDelta

log = logging.getLogger(__name__)
REPLY_EVENTS = (ResponseStarted, ResponseTextDelta, ResponseAudioDelta, ResponseFinished)


class Outbox:
    """Writes events to the client in order, one writer per connection.

    Two lanes: control events (anything not part of a reply) go out at once; reply events keep
    their order, and a reply's audio is paced at real time, at most ``lead_s`` ahead of playback.
    Text and audio deltas of a cancelled reply are dropped unsent.
    """

    def __init__(self, send: Callable[[object], Awaitable[None]], lead_s: float) -> None:
        self._send = send
        self._lead_s = lead_s
        self._control: deque[object] = deque()
        self._replies: deque[object] = deque()
        self._wake = asyncio.Event()

    def put(self, event: object) -> None:
        (self._replies if isinstance(event, REPLY_EVENTS) else self._control).append(event)
        self._wake.set()

    def flush(self) -> None:
        """Drop the queued deltas of cancelled replies and wake the writer."""
        self._replies = deque(e for e in self._replies if not _stale(e))
        self._wake.set()

    async def sync(self) -> None:
        """Wait until every control event queued so far has been sent."""
        sent = asyncio.get_running_loop().create_future()
        self._control.append(sent)
        self._wake.set()
        await sent

    async def run(self) -> None:
        """Send events until cancelled."""
        while True:
            self._wake.clear()
            if self._control:
                event = self._control.popleft()
                if isinstance(event, asyncio.Future):
                    if not event.done():
                        event.set_result(None)
                else:
                    await self._deliver(event)
                continue
            if self._replies:
                event = self._replies[0]
                if _stale(event):
                    self._replies.popleft()
                    continue
                delay = None if event.reply.held else self._due(event) - time.perf_counter()
                if delay is not None and delay <= 0:
                    self._replies.popleft()
                    await self._deliver(event)
                    continue
                timeout: float | None = delay
            else:
                timeout = None
            try:  # not asyncio.wait_for: in 3.11 it can swallow a cancel that races with the wake-up
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _deliver(self, event: object) -> None:
        try:
            await self._send(event)
        except Exception:  # one event that cannot be sent must not silence the session
            log.exception("could not send a %s event; the session goes on", type(event).__name__)

    def _due(self, event: object) -> float:
        if not isinstance(event, ResponseAudioDelta) or event.reply.play_start is None:
            return 0.0
        return event.reply.play_start + event.reply.audio_sent_s - self._lead_s


def _stale(event: object) -> bool:
    if isinstance(event, REPLY_EVENTS) and event.reply.discarded:
        return True
    return isinstance(event, (ResponseTextDelta, ResponseAudioDelta)) and event.reply.token.cancelled


__all__ = ["REPLY_EVENTS", "Outbox"]
