"""Cancellation: a token per piece of work, and a generation counter that cancels older work.

Barge-in is "start a new generation": every token handed out for the reply being spoken sees
``cancelled`` turn true at once, from any thread, without tracking the tokens one by one.
"""

from __future__ import annotations

import threading


class Generation:
    """A counter of reply generations; ``advance()`` cancels every token of older generations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = 0

    @property
    def current(self) -> int:
        return self._current

    def advance(self) -> CancelToken:
        """Start a new generation (cancelling the older ones) and return a token for it."""
        with self._lock:
            self._current += 1
            return CancelToken(self, self._current)


class CancelToken:
    """Cancelled by ``cancel()``, or when its generation (if any) is no longer the current one."""

    def __init__(self, generation: Generation | None = None, number: int = 0) -> None:
        self._event = threading.Event()
        self._generation = generation
        self._number = number

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        if self._event.is_set():
            return True
        return self._generation is not None and self._generation.current != self._number
