"""`SmartAllocator`: the layers composed into one decision per control interval, with the state
they keep between intervals (the adapter's weights, the tuner's offset, the burst detector, the
operator's override)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.config import finite_number as _num
from common.contract import DECISION_SOURCES
from node_agent.allocator.base import OnnxPolicy, PolicyLoadError, base_layer
from node_agent.allocator.config import AllocatorConfig
from node_agent.allocator.curve import CurveGuard, curve_layer, saturated
from node_agent.allocator.decision import AllocatorDecision
from node_agent.allocator.guards import guard_layer
from node_agent.allocator.override import Override, override_layer
from node_agent.allocator.recovery import RecoveryController, recovery_layer
from node_agent.allocator.residual import ResidualAdapter, ResidualUpdate, residual_layer
from node_agent.allocator.tuner import OperatingPointTuner
from node_agent.features import NUM_FEATURES, FeatureError, WindowStats, build_features, check_stats


@dataclass(frozen=True)
class PolicySwap:
    previous_policy_id: str | None
    policy_id: str
    providers: list[str]
    now_s: float | None


#: the format of `SmartAllocator.snapshot`
SNAPSHOT_VERSION = 1


class SmartAllocator:
    """The node's EMB:KV split controller (see the module docstring for the layers).

    Call order per control interval: ``observe(stats)`` (learn from the previous decision's
    outcome), then ``decide(stats, now_s)``. ``load_policy`` swaps the base policy atomically: the
    new one is fully checked before it replaces the old, and a refused one raises
    `PolicyLoadError` while the old keeps running. ``set_override`` / ``clear_override`` are the
    operator's controls; ``reset_residual`` zeroes the adapter. ``state()`` reports everything.
    """

    def __init__(self, config: AllocatorConfig | None = None, policy_dir: str | Path | None = None):
        self.config = config or AllocatorConfig()
        self.residual = ResidualAdapter(self.config.residual)
        self.recovery = RecoveryController(self.config.recovery)
        self.tuner = OperatingPointTuner(self.config.tuner)
        self.curve = CurveGuard(self.config.curve)
        self._curves = None  # the memory's miss-ratio curves for the next decision (`read_curves`)
        self._policy: OnnxPolicy | None = None
        self._scratch = np.zeros(NUM_FEATURES, dtype=np.float32)  # feature buffer when no policy is loaded
        self._share: float | None = None
        self._prev_stats: WindowStats | None = None
        self._last_now_s: float | None = None
        self._seq = 0
        self._override: Override | None = None
        self._pending: AllocatorDecision | None = None
        self._pending_learnable = False
        self.last_decision: AllocatorDecision | None = None
        self.last_load_error: str | None = None
        self.num_decisions = {s: 0 for s in DECISION_SOURCES}
        self.num_at_bound = {"min": 0, "max": 0}  # decisions the guard clamped to a bound (pinned-at-a-bound alert)
        self._lock = threading.Lock()  # serialises load_policy with itself (decide reads one reference)
        if policy_dir is not None:
            self.load_policy(policy_dir)

    # ---- policy
    @property
    def policy(self) -> OnnxPolicy | None:
        return self._policy

    def load_policy(self, artifact_dir: str | Path, now_s: float | None = None) -> PolicySwap:
        """Load, check and swap in a new base policy; on refusal raise `PolicyLoadError` and keep
        the previous policy running."""
        c = self.config
        with self._lock:
            try:
                new = OnnxPolicy(artifact_dir, device=c.device, intra_op_num_threads=c.intra_op_num_threads,
                                 golden_tolerance=c.golden_tolerance)
            except PolicyLoadError as e:
                self.last_load_error = str(e)
                raise
            old = self._policy
            self._policy = new
            self.last_load_error = None
            if old is not None and self.config.residual.reset_on_policy_swap:
                self.residual.reset(f"base policy swapped: {old.policy_id} -> {new.policy_id}")
                self.tuner.reset(f"base policy swapped: {old.policy_id} -> {new.policy_id}")
                self._pending = None  # the last decision's correction belongs to the old policy
        return PolicySwap(previous_policy_id=old.policy_id if old else None, policy_id=new.policy_id,
                          providers=new.providers, now_s=now_s)

    # ---- operator
    def set_override(self, emb_share: float, *, now_s: float, expires_at_s: float | None = None,
                     reason: str = "operator override") -> Override:
        g = self.config.guard
        if not (_num(emb_share) and g.min_emb_share <= emb_share <= g.max_emb_share):
            raise ValueError(f"override emb_share must be within the guard bounds [{g.min_emb_share}, "
                             f"{g.max_emb_share}], got {emb_share!r}")
        if not _num(now_s):
            raise ValueError(f"now_s must be a finite number, got {now_s!r}")
        if expires_at_s is not None and not (_num(expires_at_s) and expires_at_s > now_s):
            raise ValueError(f"expires_at_s must be a finite time after now_s={now_s}, got {expires_at_s!r}")
        self._override = Override(float(emb_share), float(now_s), expires_at_s, str(reason))
        return self._override

    def clear_override(self) -> Override | None:
        old, self._override = self._override, None
        return old

    @property
    def override(self) -> Override | None:
        return self._override

    def reset_residual(self, reason: str = "operator reset") -> None:
        """Zero the residual layer: the adapter's weights and the operating-point tuner's offset."""
        self.residual.reset(reason)
        self.tuner.reset(reason)

    # ---- the decision
    def read_curves(self, curves) -> None:
        """The node's miss-ratio curves (`node_agent.memory.MemoryManager.miss_curves`, or None)
        for the next `decide`: the control step (`node_agent.control.control_step`) hands them
        over with the window's stats. A decision uses them once."""
        self._curves = curves

    def decide(self, stats: WindowStats, now_s: float) -> AllocatorDecision:
        """One decision for the coming interval from ``stats`` of the interval that just ended:
        the layers in order, each on the previous one's proposal, then the state they feed back
        (the anti-windup, an expired override) and the record."""
        if self._last_now_s is not None and not now_s >= self._last_now_s:
            raise ValueError(f"now_s went backwards or is not a number: {now_s!r} after {self._last_now_s!r}")
        self._last_now_s = now_s
        c = self.config
        policy = self._policy
        row = policy.input_row if policy is not None else self._scratch
        try:
            build_features(stats, self._prev_stats, out=row)
            hold = None
            self._prev_stats = stats
        except FeatureError as e:
            row[:] = 0.0
            hold = str(e)
        prev = self._share
        if prev is None:
            prev = stats.emb_share if hold is None else c.initial_emb_share
        ov = self._override
        notes = ()

        proposal, t = base_layer(policy, hold, prev)
        layers = [t]
        source = "base" if t.acted else "guard"
        learnable = t.acted
        res_t = None
        if learnable:
            proposal, res_t = residual_layer(self.residual, self.tuner, row, stats, proposal, prev, c.guard,
                                             ov is None or ov.expired(now_s))
            layers.append(res_t)
            if res_t.acted:
                source = "residual"
        curves, self._curves = self._curves, None
        sat = hold is None and saturated(stats, c.curve.rho_max)  # (invalid stats are never read)
        jump = False
        cost = None
        if hold is None and c.curve.enabled and curves is not None:
            proposal_in = proposal
            proposal, t = curve_layer(self.curve, curves, stats, proposal, prev, c.guard)
            layers.append(t)
            jump = t.values[0] == "jump"
            t_min, t_prev = t.values[2], t.values[4]
            if jump and self.curve.jumped_first:
                notes += (f"the first decision on the curves: jump to {t.values[1]:.2f} at once (the split in "
                          f"force has no curve behind it; the minimum saves {100 * (t_prev - t_min) / t_prev:.1f}% "
                          "of its time)",)
            elif jump and t_prev > 0 and t_prev - t_min < c.curve.jump_gain * t_prev:
                notes += (f"a saturated node's jump to {t.values[1]:.2f}: the capped queueing cost sees a cliff "
                          f"there (on the tangent it saves {100 * (t_prev - t_min) / t_prev:.1f}% of the split in "
                          "force's)",)
            if t.values[0] != "no_curve":
                cost = t.values[10]
            if t.acted:
                source, learnable = "guard", False
                if res_t is not None and t.values[0] in ("flat", "refuse_step"):  # the offset stays with the split
                    back = self._take_back(proposal_in - proposal, res_t.values[3])
                    if back != 0.0:
                        t.values = t.values[:-1] + (back,)
        if hold is None and c.recovery.enabled:
            # a saturated node completes requests a backlog late: its arrivals show a burst first
            hot = (stats.arrival_hot_user_ratio if c.recovery.hot_over_arrivals and sat and stats.arrival_hot_user_ratio > 0
                   else stats.hot_user_ratio)
            # on a saturated node an unpaced burst's cap is not declined: the curves' histograms
            # still hold the reuse from before the burst
            sat_burst = not c.recovery.paced and sat
            proposal, t, note = recovery_layer(self.recovery, stats.arrival_rate_rps, hot, now_s,
                                               prev, proposal, source, cost, 0.0 if sat_burst else c.curve.flat_gain)
            layers.append(t)
            if t.acted:
                source, learnable = "recovery", False
            if note is not None:
                notes += (note,)
        if ov is not None:
            proposal, t, note = override_layer(ov, now_s, proposal, source)
            layers.append(t)
            if t.acted:
                source, learnable = "override", False
            else:
                self._override = None
                notes += (note,)
        layer_source = source
        # in a burst a KV-ward step (whichever layer proposed it) is not paced: the burst's hot users
        # need their K/V now, each interval above the split they need costs them, and shrinking the
        # EMB slab is metadata-only
        unpaced = hold is None and source != "override" and self.recovery.active and not c.recovery.paced
        share, t = guard_layer(proposal, prev, c.guard, source, source != "override", not (jump or unpaced))
        layers.append(t)
        if unpaced and not jump and prev - share > c.guard.max_step_down + 1e-9:
            notes += (f"a burst (busy {stats.load:.2f}): KV-ward step {prev - share:.4f} "
                      f"taken at once, not paced by max_step_down {c.guard.max_step_down:g}",)
        if c.curve.flat_holds_split and layer_source in ("base", "residual", "guard") and self.curve.anchor is not None:
            self.curve.anchor = share
        if t.acted and t.values[0] in self.num_at_bound:
            self.num_at_bound[t.values[0]] += 1
        if t.acted:
            source = "guard"
            if layer_source == "residual":
                back = self._anti_windup(proposal - share, t.values[0], res_t.values[3])
                if back != 0.0:
                    t.values = t.values[:-1] + (back,)

        self._seq += 1
        d = AllocatorDecision(self._seq, now_s, share, source, tuple(layers), prev, proposal, layer_source,
                              self.recovery.phase, policy.policy_id if policy is not None else None, row.copy(), notes)
        self._share = share
        self._pending = d
        self._pending_learnable = learnable and self.residual.config.enabled
        self.num_decisions[source] += 1
        self.last_decision = d
        return d

    def _anti_windup(self, refused: float, action: str, step: float) -> float:
        """Take back the part of the tuner's ``step`` that the guards' step limit refused (the
        offset never runs ahead of the split in force); returns the amount taken back (0: none)."""
        if action != "step_up" and action != "step_down":
            return 0.0
        return self._take_back(refused, step)

    def _take_back(self, refused: float, step: float) -> float:
        """Take back from the tuner the part of its ``step`` that a later layer ``refused`` (same
        sign); returns the amount taken back (0: none)."""
        if step == 0.0 or (refused > 0) != (step > 0):
            return 0.0
        back = min(refused, step) if step > 0 else max(refused, step)
        if back != 0.0:
            self.tuner.take_back(back)
        return back

    def observe(self, outcome: WindowStats) -> ResidualUpdate:
        """Train the residual adapter on the outcome (the stats of the interval that ran under the
        last decision). Each decision is learnt from at most once; intervals run under an
        override, a burst, or a hold (invalid stats, no/failed base) are skipped, as are empty
        intervals (no requests: no latency evidence)."""
        d, self._pending = self._pending, None
        ra = self.residual
        if not ra.config.enabled:
            return ra.skip("residual adapter disabled")
        if d is None:
            return ra.skip("no decision to pair the outcome with")
        if not self._pending_learnable:
            return ra.skip(f"decision {d.seq} ran under {d.source}, not base + residual: its outcome does not "
                           "measure the correction")
        try:
            check_stats(outcome)  # the check `decide` makes of its stats (fast; the problems named on failure)
        except FeatureError as e:
            return ra.skip("invalid outcome: " + "; ".join(e.problems))
        if outcome.num_requests == 0:
            return ra.skip("no requests in the interval: no latency evidence")
        return ra.update(d.features, d.residual, outcome)

    # ---- reporting
    # ---- what a restart resumes from
    def snapshot(self) -> dict:
        """The state a restarted node resumes from (`restore`): the split in force, the base
        policy's id, the residual adapter's weights and the tuner's offset. The burst detector's
        baselines are not kept: a restart learns them again within its warm-up."""
        return {"version": SNAPSHOT_VERSION, "emb_share": self._share,
                "policy_id": self._policy.policy_id if self._policy is not None else None,
                "residual_weights": [float(v) for v in self.residual._w], "tuner_offset": float(self.tuner.offset)}

    def restore(self, snap: dict) -> str:
        """Resume from a `snapshot` (ValueError for one that is malformed): the split always, the
        residual weights and the tuner offset only when the same base policy is loaded (they
        corrected that policy). Returns what was restored, in words."""
        if not isinstance(snap, dict) or snap.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"allocator snapshot: version {SNAPSHOT_VERSION} expected")
        share = snap.get("emb_share")
        if share is not None and not (isinstance(share, (int, float)) and 0.0 <= float(share) <= 1.0):
            raise ValueError(f"allocator snapshot: emb_share {share!r} is not in [0, 1]")
        offset = snap.get("tuner_offset", 0.0)
        if not (isinstance(offset, (int, float)) and math.isfinite(offset) and abs(offset) <= 1.0):
            raise ValueError(f"allocator snapshot: tuner_offset {offset!r} is not in [-1, 1]")
        same = self._policy is not None and snap.get("policy_id") == self._policy.policy_id
        if same:
            self.residual.load_weights(snap.get("residual_weights"))
            self.tuner.offset = float(offset)
        if share is not None:
            self._share = float(share)
            self.curve.evidenced = True  # the split was chosen on evidence: no first jump from it
        said = "none" if share is None else f"{float(share):.4f}"
        return (f"emb_share {said}" + (f", residual weights and tuner offset {float(offset):+.3f} (policy "
                                       f"{snap.get('policy_id')})" if same else
                                       f"; residual and tuner start afresh (they corrected policy "
                                       f"{snap.get('policy_id')}, this node runs another)"))

    def state(self) -> dict:
        ov = self._override
        return {
            "emb_share": self._share,
            "policy": self._policy.describe() if self._policy is not None else None,
            "last_load_error": self.last_load_error,
            "override": None if ov is None else {"emb_share": ov.emb_share, "set_at_s": ov.set_at_s,
                                                 "expires_at_s": ov.expires_at_s, "reason": ov.reason},
            "residual": self.residual.state().to_dict(),
            "recovery": self.recovery.state().to_dict(),
            "tuner": self.tuner.state().to_dict(),
            "curve": self.curve.state(),
            "num_decisions": dict(self.num_decisions),
            "num_at_bound": dict(self.num_at_bound),
            "last_decision": self.last_decision.to_dict() if self.last_decision is not None else None,
        }
