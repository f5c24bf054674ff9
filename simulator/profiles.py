"""Cost profiles for the simulator: the device model's profiles (`common.device_model`, the one
definition the emulated node agent charges too) and the paper-scale setting (`PaperScale`).

`CostProfile`, `A100_HSTU`, `PROFILES`, `from_node_profile` and `get_profile` are
`common.device_model`'s, re-exported here. Every profile's ``sources`` says where each field came
from (it is in its JSON): a preset's public source or arithmetic; for a profile derived from a
node (`from_node_profile`) ``measured ...``, ``emulated ...`` or ``assumed ...`` (the fields it
keeps from the preset, batching and overheads among them); for `PaperScale.profile` the four
fields it scales.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from common.config import ranged, require
from common.config import validate as validate_fields
from common.device_model import (_BF16, _D, _LAYERS, A100_HSTU, PROFILES, CostProfile,  # noqa: F401 (re-exported)
                                 from_node_profile, get_profile)

# --- the paper-scale setting, fixed before any of its results was seen --------------------------
# Every full-scale figure below carries its source or derivation; `PaperScale.scaled(f)` gives the
# per-node setting the simulator runs, shrunk by one factor `f` that keeps the ratios which decide
# the EMB-KV trade-off (docs/simulator.md, "The paper-scale setting").
_GiB = 2**30
_A100_HBM_BYTES = 80 * _GiB  # NVIDIA A100 80GB datasheet: 80 GB HBM2e
_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization: 10% for CUDA context, NCCL, fragmentation
_WEIGHT_BYTES = _LAYERS * 5 * _D * _D * _BF16  # the HSTU stack's U,V,Q,K (d -> 4d) and output (d -> d): 0.23 GiB
# activations: the largest micro-batch in flight, batch_speedup (4) requests of up to 16,384 tokens (the 15k cap
# rounded up to a power of two), d-wide, bf16, ~10 live d-wide tensors per token in an HSTU layer (U, V, Q, K of
# 4d, the input, the normalised input, the attention output and the layer output): 1.25 GiB
_ACTIVATION_BYTES = 4 * 16_384 * _D * _BF16 * 10
PAPER_ARENA_BYTES = int(_GPU_MEMORY_UTILIZATION * _A100_HBM_BYTES) - _WEIGHT_BYTES - _ACTIVATION_BYTES  # ~70.5 GiB
PAPER_TABLE_BYTES = 5 * 2**40  # the paper: embedding tables of "5 TB+" (taken as 5 TiB)


@dataclass(frozen=True)
class PaperScale:
    """The paper-scale setting at full scale (``scale`` 1) and its scale model.

    Full scale, per node (32 A100 nodes, as the paper's cluster):

    - arena: ``arena_bytes`` = 0.9 x 80 GiB - weights - activations (~70.5 GiB; profiles.py);
    - embedding table: ``table_rows`` rows of the profile's ``emb_row_bytes`` (16 KiB), 5 TiB
      (the paper's "5 TB+"); the arena is 1.38% of it;
    - users: ``num_users`` 1,000,000 (Taobao UserBehavior: 987,994 users, 4,162,024 items,
      100,150,807 events over 9 days; Tianchi dataset 649) over ``cluster_nodes`` 32 nodes:
      31,250 users per node;
    - load: ``rate_rps_per_node`` 125 req/s (the default table's 4,000 req/s over 32 nodes; the
      paper states no rate);
    - refill: the profile's link (12 GB/s) x the simulator's ``refill_limit_fraction`` (0.1): the
      whole arena refills in ~63 s;
    - histories (`workloads.scale.paper_scale_trace`): a user's history is the concatenation of
      ``P ~ U{1..periods_max}`` distinct sample users' sequences (a sample user's sequence is one
      period of activity: 9 days on Taobao), ``periods_max = ceil(history_tail / longest sample
      sequence)`` so the longest history reaches ``history_tail`` (15,000, the paper's "15k+");
      capped at the stream's ``max_history_len`` (15,000);
    - item popularity: a Zipf law over the table's rows whose exponent is the least-squares
      slope of log(count) on log(rank) over every item of the sample (Taobao 0.454, Amazon 0.881),
      repeats within a sample sequence kept (`workloads.scale`).

    Scale model: ``scale`` f multiplies the arena, the table's row count, the K/V bytes per
    token and the refill bandwidth; row bytes, history lengths (tokens), users per node, requests
    per node per second and every time cost stay. So arena / table bytes, arena / a user's K/V
    bytes, users per node, requests per node per second and refill bandwidth / arena are those
    of full scale. A KV page must hold whole EMB rows, so the page grows from 16 tokens by powers
    of two as the K/V bytes per token shrink (f = 1/192: 32 tokens, one 16 KiB row; f = 1/384:
    64 tokens). The simulator runs a slice of ``nodes`` nodes of the cluster (users and rate in
    proportion); the router sees fewer nodes than 32, each node the same load.
    """

    arena_bytes: int = PAPER_ARENA_BYTES
    table_rows: int = PAPER_TABLE_BYTES // (16 * 1024)  # 335,544,320 rows of 16 KiB
    num_users: int = 1_000_000
    cluster_nodes: int = 32
    rate_rps_per_node: float = 125.0
    history_tail: int = 15_000
    scale: float = ranged(1 / 192, lo=0, hi=1, lo_open=True)

    @property
    def users_per_node(self) -> int:
        return self.num_users // self.cluster_nodes

    def validate(self, profile: CostProfile = A100_HSTU) -> "PaperScale":
        validate_fields(self, "paper-scale")
        kv = self.kv_bytes_per_token(profile)
        require(self, kv >= 8 and kv % 8 == 0,
                f"scale {self.scale} gives {kv} K/V bytes per token; want a multiple of 8", "paper-scale")
        self.page_tokens(profile)
        return self

    def kv_bytes_per_token(self, profile: CostProfile = A100_HSTU) -> int:
        return int(round(profile.kv_bytes_per_token * self.scale))

    def page_tokens(self, profile: CostProfile = A100_HSTU) -> int:
        """The smallest 16 x 2^k tokens whose page holds a whole number of EMB rows."""
        kv, t = self.kv_bytes_per_token(profile), profile.page_tokens
        while (t * kv) % profile.emb_row_bytes:
            t *= 2
            if t > 1 << 16:
                raise ValueError(f"paper-scale: scale {self.scale} gives no page of whole {profile.emb_row_bytes}-byte "
                                 f"rows; use 1/96, 1/192, 1/384, ...")
        return t

    def scaled_rows(self) -> int:
        return int(round(self.table_rows * self.scale))

    def scaled_arena_bytes(self) -> int:
        return int(self.arena_bytes * self.scale)

    def profile(self, base: CostProfile = A100_HSTU) -> CostProfile:
        """``base`` with the scale model's byte sizes (K/V bytes per token, page, arena, link)."""
        self.validate(base)
        f = f"1/{1 / self.scale:g}"
        how = f"assumed from PaperScale (simulator/profiles.py) at scale {f}"
        sources = dict(base.sources,
                       kv_bytes_per_token=f"{how}: {base.name}'s x {f}, rounded",
                       page_tokens=f"{how}: the smallest 16 x 2^k tokens whose page holds whole EMB rows",
                       hbm_cache_bytes=f"{how}: 0.9 x 80 GiB - weights - activations, x {f}",
                       link_bytes_per_s=f"{how}: {base.name}'s x {f}")
        return replace(base, name=f"{base.name}@paper-scale/{1 / self.scale:g}",
                       kv_bytes_per_token=self.kv_bytes_per_token(base), page_tokens=self.page_tokens(base),
                       hbm_cache_bytes=self.scaled_arena_bytes(), link_bytes_per_s=base.link_bytes_per_s * self.scale,
                       sources=sources).validate()

    def ratios(self, mean_history_tokens: float, base: CostProfile = A100_HSTU) -> dict:
        """The ratios the scale model keeps, at this scale (equal at every scale but for rounding)."""
        p = self.profile(base)
        arena = self.scaled_arena_bytes()
        return {"arena_over_table_bytes": arena / (self.scaled_rows() * p.emb_row_bytes),
                "arena_over_user_kv_bytes": arena / (mean_history_tokens * p.kv_bytes_per_token),
                "users_per_node": self.users_per_node, "rate_rps_per_node": self.rate_rps_per_node,
                "refill_bytes_per_s_over_arena": 0.1 * p.link_bytes_per_s / arena}

    def to_json(self) -> dict:
        return asdict(self) | {"users_per_node": self.users_per_node, "scaled_rows": self.scaled_rows(),
                               "scaled_arena_bytes": self.scaled_arena_bytes(),
                               "kv_bytes_per_token": self.kv_bytes_per_token(),
                               "page_tokens": self.page_tokens()}


PAPER_SCALE = PaperScale()
