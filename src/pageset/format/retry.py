"""One retry policy for every request pageset sends to a store, reading (``read/remote.py``) and writing
(``write/upload.py``, the writers' ``request_timeout`` / ``request_attempts``).

:class:`RetryPolicy` bounds a request: ``timeout`` seconds per attempt, ``attempts`` attempts (the first
included), and between attempt ``i`` and ``i + 1`` a sleep of ``min(backoff_max, backoff * 2**i)`` seconds times a
random factor in [0.5, 1] (jitter, "full jitter" halved: AWS Architecture Blog, "Exponential Backoff And Jitter",
2015). With the defaults a request that never answers fails within :attr:`RetryPolicy.bound` = 151.5 s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Per-request ``timeout`` (seconds, > 0), ``attempts`` (an int >= 1, the first try included) and the backoff
    between attempts: ``min(backoff_max, backoff * 2**i)`` seconds times a random factor in [0.5, 1].

    Raises ValueError naming ``request_timeout`` / ``request_attempts`` (the callers' argument names) when a value
    is out of range."""

    timeout: float = 30.0
    attempts: int = 5
    backoff: float = 0.1
    backoff_max: float = 5.0

    def __post_init__(self):
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"request_timeout must be a number of seconds > 0, got {self.timeout!r}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"request_attempts must be an int >= 1, got {self.attempts!r}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to sleep after the failed attempt ``attempt`` (0-based), drawn from ``rng``."""
        return min(self.backoff_max, self.backoff * (2 ** attempt)) * rng.uniform(0.5, 1.0)

    @property
    def backoff_total(self) -> float:
        """The longest total sleep between the attempts of one request (seconds)."""
        return sum(min(self.backoff_max, self.backoff * (2 ** i)) for i in range(self.attempts - 1))

    @property
    def bound(self) -> float:
        """Seconds one request may take at most, every attempt included: ``attempts x timeout`` plus
        :attr:`backoff_total` (5 x 30 s + 1.5 s = 151.5 s by default)."""
        return self.attempts * self.timeout + self.backoff_total

    def describe(self) -> str:
        return (f"request_attempts {self.attempts} x request_timeout {self.timeout:g} s + backoff "
                f"{self.backoff_total:.2f} s = {self.bound:.2f} s")
