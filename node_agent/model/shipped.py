"""The checkpoints shipped with RACER (``node_agent/model/checkpoints/<trace>/``), trained on the
bundled sample traces (``racer model train``; docs/model.md has the commands), and how ``racer
up`` picks the model its agents serve. No torch here: ``racer up`` imports this."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "checkpoints"


def shipped_checkpoint(trace_kind: str) -> Path | None:
    """The shipped checkpoint for the bundled sample of ``trace_kind``, or None."""
    d = SHIPPED_DIR / trace_kind
    return d if (d / "manifest.json").is_file() else None


def resolve_model(choice: str | None, trace_kind: str, trace_path: str | None) -> Path | None:
    """``racer up --model``: ``auto`` (the shipped checkpoint when the trace is the bundled sample
    and one is shipped for it, else None), ``none`` (random weights), or a checkpoint directory."""
    if choice is None or choice == "none":
        return None
    if choice == "auto":
        return shipped_checkpoint(trace_kind) if trace_path is None else None
    return Path(choice)
