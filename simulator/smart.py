"""The SmartAllocator's layers as simulator allocators (the paper table's ablation rows).

    make_smart_allocator("racer")          # base + residual adapter + recovery controller
    make_smart_allocator("ppo")            # the frozen base policy alone
    make_smart_allocator("ppo+residual")   # base + residual adapter
    make_smart_allocator("ppo+recovery")   # base + recovery controller
    make_smart_allocator("racer@ghost")    # any of them with the residual adapter on the ghost signal

The residual layer (``racer``, ``ppo+residual``) is the bounded adapter plus the
operating-point tuner (`node_agent.allocator.OperatingPointTuner`), which reads the caches'
marginal utilities from their ghost lists; a spec ending in ``@ghost`` also runs the adapter on
them (``ResidualConfig(signal="ghost")``). The simulator runs such rows with ghost lists on
(``SimConfig.ghost_probes``, which the table sets for them: `needs_ghost_lists`), as the node
agent runs with them on by default (`node_agent.engine.EngineConfig.ghost_probes`).

Each simulated node gets its own `node_agent.allocator.SmartAllocator` (the node agent's runtime,
unchanged: ONNX base policy in onnxruntime, residual adapter, burst recovery controller, guards),
loaded from ``policies/default`` unless another artifact directory is given. Every control
interval the simulator hands the node's `WindowStats` to `SmartAllocatorSim.decide`, which does
what the node agent does: ``observe(stats)`` (the adapter learns from the outcome of its previous
decision) and then ``decide(stats, now_s)``; the decision's ``emb_share`` is the node's target.
The allocator's ``name`` is the spec string, so the table's rows are labelled by it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from node_agent.allocator import AllocatorConfig, CurveConfig, RecoveryConfig, ResidualConfig, SmartAllocator, TunerConfig

from .allocators import GHOST_SUFFIX, Allocator

DEFAULT_ARTIFACT = Path(__file__).resolve().parent.parent / "policies" / "default"

# spec -> (residual layer on: the adapter and the operating-point tuner, recovery controller on)
SMART_SPECS: dict[str, tuple[bool, bool]] = {
    "racer": (True, True),
    "ppo": (False, False),
    "ppo+residual": (True, False),
    "ppo+recovery": (False, True),
}


def smart_config(spec: str, base: AllocatorConfig | None = None) -> AllocatorConfig:
    """The `AllocatorConfig` of an ablation: ``base`` (default `AllocatorConfig()`) with the
    residual adapter and the recovery controller switched on or off as ``spec`` says (and, with
    the ``@ghost`` suffix, the adapter on the ghost signal)."""
    on_ghost = spec.endswith(GHOST_SUFFIX)
    name = spec[: -len(GHOST_SUFFIX)] if on_ghost else spec
    if name not in SMART_SPECS:
        raise ValueError(f"unknown SmartAllocator spec {spec!r}: use one of {', '.join(SMART_SPECS)}, "
                         f"optionally with {GHOST_SUFFIX}")
    residual_on, recovery_on = SMART_SPECS[name]
    base = base or AllocatorConfig()
    signal = "ghost" if on_ghost else base.residual.signal
    return AllocatorConfig(
        guard=base.guard,
        residual=ResidualConfig(**{**_fields(base.residual), "enabled": residual_on, "signal": signal}),
        recovery=RecoveryConfig(**{**_fields(base.recovery), "enabled": recovery_on}),
        tuner=TunerConfig(**{**_fields(base.tuner), "enabled": residual_on and base.tuner.enabled}),
        curve=CurveConfig(**{**_fields(base.curve), "enabled": residual_on and base.curve.enabled}),
        initial_emb_share=base.initial_emb_share, device=base.device,
        intra_op_num_threads=base.intra_op_num_threads, golden_tolerance=base.golden_tolerance)


def _fields(cfg) -> dict:
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}


class SmartAllocatorSim(Allocator):
    """One `SmartAllocator` per simulated node, created (and the policy loaded and checked) at
    `reset`. ``decisions_by_source`` counts the decisions of the last run by source (``base``,
    ``residual``, ``recovery``, ``override``, ``guard``); ``allocators`` holds the per-node
    runtimes (their ``state()`` says everything)."""

    def __init__(self, spec: str, artifact_dir: str | Path | None = None, config: AllocatorConfig | None = None):
        super().__init__()
        self.config = smart_config(spec, config)
        self.name = spec
        self.artifact_dir = Path(artifact_dir) if artifact_dir is not None else DEFAULT_ARTIFACT
        if not (self.artifact_dir / "manifest.json").is_file():
            raise FileNotFoundError(f"{self.artifact_dir}: no policy artifact (train one with `racer policy train`, "
                                    "then `racer policy export`)")

    @property
    def allocators(self) -> list[SmartAllocator]:
        return self.nodes

    def make_node(self, node: int, initial_share: float) -> SmartAllocator:
        # the node agent's runtime, unchanged; `Allocator.decide` runs its control step
        # (node_agent.control.decide_step: observe the previous decision's outcome, then decide)
        return SmartAllocator(replace(self.config, initial_emb_share=initial_share), policy_dir=self.artifact_dir)


def make_smart_allocator(spec: str, artifact_dir: str | Path | None = None,
                         config: AllocatorConfig | None = None) -> SmartAllocatorSim:
    """The simulator allocator for ``spec`` (``racer``, ``ppo``, ``ppo+residual``, ``ppo+recovery``),
    with the policy at ``artifact_dir`` (default ``policies/default``); ``config`` supplies the
    other settings (guards, thresholds), the spec decides which layers are on."""
    return SmartAllocatorSim(spec, artifact_dir, config)
