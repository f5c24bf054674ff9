"""SmartAllocator: one EMB:KV split decision per control interval (see docs/allocator.md).

    alloc = SmartAllocator(AllocatorConfig(), policy_dir="policies/default")
    every control interval, with the stats of the interval that just ended:
        alloc.observe(stats)                  # the residual adapter learns from the last decision
        decision = alloc.decide(stats, now_s) # -> AllocatorDecision; decision.emb_share feeds the memory manager

One module per layer; each layer is a function that takes the window's inputs and the previous
layer's proposal and returns ``(proposal, LayerTrace)``; `SmartAllocator.decide` composes them in
order, and the decision records every trace (``decision.layers``) and which layer set its value
(``source``); its reason in words is rendered from the traces.

1. ``base`` (`base.py`): the frozen actor in onnxruntime (`OnnxPolicy`; the shipped one behaviour-cloned,
   with no PPO update): CUDA provider only
   when ``torch.cuda.is_available()``, else CPU; one intra-op thread; input and output bound in
   advance (IOBinding) to preallocated numpy buffers, into which `build_features` writes directly.
2. ``residual`` (`residual.py`, `tuner.py`): `ResidualAdapter`, a linear model of the features
   trained online by normalised LMS after each interval, its correction bounded by
   ``|correction| <= max_correction`` (0.1); and `OperatingPointTuner`, an offset moved every
   interval along the node's busy-time gradient measured by the caches' ghost lists, over the
   whole guard range: it finds a setting's operating point online where the base policy is far
   from it.
3. ``curve`` (`curve.py`): the caches' miss-ratio curves (`node_agent.memory.mrc`) as an expected
   time per request at every share; moves the proposal to the curve's minimum when that saves
   much, refuses a step over a cliff (source ``guard`` when it acts); runs only when the control
   step handed it curves (`read_curves`).
4. ``recovery`` (`recovery.py`): `RecoveryController`, a burst detector with hysteresis over slow
   EWMA baselines of the arrival rate and the hot-user ratio; in a burst it caps emb_share at the
   split in force when the burst began minus ``kv_shift`` (memory moves to the KV cache, at once
   unless ``RecoveryConfig.paced``), then hands control back.
5. ``override`` (`override.py`): an operator's emb_share (validated against the bounds when set),
   which takes precedence over every layer until it expires (``expires_at_s``, against ``now_s``).
6. ``guard`` (`guards.py`): the max step per decision (asymmetric: growing EMB needs a background
   refill, shrinking it is metadata-only; the step-down limit is waived for the curve layer's
   ``jump``, and unless ``paced`` in a burst) and then the [min, max] bounds; the source becomes
   ``guard`` when a guard changed the value, and also when the allocator had to hold the split
   (invalid stats, a non-finite base output, no policy loaded). When the step limit refuses part
   of the tuner's step, that part is taken back from its offset (anti-windup).

Pure over snapshots: nothing here reads the clock; ``now_s`` comes with every call.
"""

from common.contract import DECISION_SOURCES, LAYERS
from node_agent.allocator.base import OnnxPolicy, PolicyLoadError, base_layer, cuda_available
from node_agent.allocator.config import (RESIDUAL_SIGNALS, AllocatorConfig, CurveConfig, GuardConfig, RecoveryConfig,
                                         ResidualConfig, TunerConfig)
from node_agent.allocator.curve import CURVE_ACTIONS, CurveGuard, curve_layer, expected_costs
from node_agent.allocator.decision import AllocatorDecision
from node_agent.allocator.guards import GUARD_ACTIONS, guard_layer, guard_stage
from node_agent.allocator.override import Override, override_layer
from node_agent.allocator.recovery import RecoveryController, RecoveryState, recovery_layer
from node_agent.allocator.residual import (ResidualAdapter, ResidualState, ResidualUpdate,
                                           residual_layer)
from node_agent.allocator.smart import PolicySwap, SmartAllocator
from node_agent.allocator.trace import LayerTrace
from node_agent.allocator.tuner import TUNER_ACTIONS, OperatingPointTuner, TunerState

__all__ = ["CURVE_ACTIONS", "CurveConfig", "CurveGuard", "curve_layer", "expected_costs", "DECISION_SOURCES", "GUARD_ACTIONS", "LAYERS", "RESIDUAL_SIGNALS", "TUNER_ACTIONS", "AllocatorConfig",
           "AllocatorDecision", "GuardConfig", "LayerTrace", "OnnxPolicy", "OperatingPointTuner", "Override",
           "PolicyLoadError", "PolicySwap", "RecoveryConfig", "RecoveryController", "RecoveryState",
           "ResidualAdapter", "ResidualConfig", "ResidualState", "ResidualUpdate", "SmartAllocator", "TunerConfig",
           "TunerState", "base_layer", "cuda_available", "guard_layer", "guard_stage", "override_layer",
           "recovery_layer", "residual_layer"]
