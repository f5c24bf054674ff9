"""The GR model: an HSTU-style transformer with per-user K/V reuse and candidate ranking.

The names below load `hstu` (and torch) on first use, so ``racer model --help`` imports no torch.
"""

from __future__ import annotations

__all__ = ["HSTULayer", "HSTUModel", "KVBlock", "KVState", "MASKED", "ModelConfig", "log_bucket"]


def __getattr__(name: str):
    if name in __all__:
        from . import hstu

        return getattr(hstu, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
