"""Token bucket in bytes with injected time (``now_s``); never reads the clock."""

from __future__ import annotations


class TokenBucket:
    """Tokens (bytes) accrue at ``rate_bytes_per_s`` up to ``capacity_bytes``; a send of ``n``
    bytes needs ``n`` tokens. Over any interval of length ``w``, at most
    ``capacity_bytes + rate_bytes_per_s * w`` bytes pass (see ``RefillConfig``).

    Time only moves forward: an earlier ``now_s`` than the last one seen is treated as no time
    passing.
    """

    def __init__(self, rate_bytes_per_s: float, capacity_bytes: float, now_s: float,
                 start_full: bool = True) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"rate_bytes_per_s must be > 0, got {rate_bytes_per_s}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.rate_bytes_per_s = float(rate_bytes_per_s)
        self.capacity_bytes = float(capacity_bytes)
        self.tokens = self.capacity_bytes if start_full else 0.0
        self.last_s = float(now_s)

    def _advance(self, now_s: float) -> None:
        if now_s > self.last_s:
            self.tokens = min(
                self.capacity_bytes, self.tokens + (now_s - self.last_s) * self.rate_bytes_per_s
            )
            self.last_s = now_s

    def available(self, now_s: float) -> float:
        """Bytes that may be sent at ``now_s``."""
        self._advance(now_s)
        return self.tokens

    def take(self, num_bytes: float, now_s: float) -> bool:
        """Spend ``num_bytes`` if available at ``now_s``; False (and nothing spent) otherwise."""
        self._advance(now_s)
        if num_bytes > self.tokens:
            return False
        self.tokens -= num_bytes
        return True

    def check_invariants(self) -> list[str]:
        out = []
        if not -1e-6 <= self.tokens <= self.capacity_bytes + 1e-6:
            out.append(f"token bucket: tokens {self.tokens} outside [0, {self.capacity_bytes}]")
        return out
