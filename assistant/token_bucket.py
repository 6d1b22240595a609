"""A token bucket: at most ``rate`` events per second on average, in bursts of up to ``burst``.

Each Realtime session has one for its client events; an event that finds the bucket empty is
refused (``rate_limited``) without being looked at.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    rate: float  # tokens added per second
    burst: float  # the bucket's size (and its content at the start)
    tokens: float = field(init=False)
    _stamp: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float | None = None) -> bool:
        """Take one token if there is one; False when the bucket is empty."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    @property
    def full(self) -> bool:
        """True when the bucket had refilled completely at the last ``take`` (the client paused)."""
        return self.tokens >= self.burst - 1


__all__ = ["TokenBucket"]
