"""Cost profiles: what a node's time and memory cost in the simulator.

A profile gives the per-unit costs of the cost model (`simulator.cost`) and the byte sizes that
turn a node's HBM budget into EMB rows and KV tokens. The default, `A100_HSTU`, is an A100-class
node serving an HSTU-scale model; each figure carries its public source or the arithmetic that
derives it. `from_node_profile` reads a profile measured by ``racer node profile --json``.

The sample traces in ../shared/data are tiny next to the paper's setting (tables of TBs, 1 M+
users, histories to 15k tokens), so the simulator does not copy the A100's 40 GB cache budget: it
sizes each node's cache from the workload (``SimConfig.cache_fraction`` of the catalogue's
bytes), keeping the profile's *relative* costs (bytes per KV token vs per embedding row, µs per
recomputed token vs per transferred row), which is what decides the split.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from common.config import ranged, require
from common.config import validate as validate_fields


def _positive():
    """A required field: a finite number > 0 (an int or a float, as JSON gives it)."""
    return ranged(lo=0, lo_open=True)


def _at_least_0():
    return ranged(lo=0)


@dataclass(frozen=True)
class CostProfile:
    """Per-unit costs (µs) and sizes (bytes) of one node. `validate` checks ranges."""

    name: str
    # compute: prefilling token i (0-based position) costs token_us + attn_us_per_ctx * i
    token_us: float = _positive()
    attn_us_per_ctx: float = _at_least_0()
    # ranking: a candidate costs cand_us + attn_us_per_ctx * context_len
    cand_us: float = _at_least_0()
    # embeddings: a miss moves one row over the host link, a hit reads it from HBM
    emb_transfer_us_per_row: float = _positive()
    emb_hit_us_per_row: float = _at_least_0()
    # fixed per micro-batch (kernel launches, scheduling) and per request
    batch_overhead_us: float = _at_least_0()
    request_overhead_us: float = _at_least_0()
    # how many requests' compute a micro-batch overlaps (GPU batching efficiency)
    batch_speedup: float = ranged(lo=1)
    max_batch: int = _positive()
    # sizes
    emb_row_bytes: int = _positive()
    kv_bytes_per_token: int = _positive()
    page_tokens: int = _positive()
    hbm_cache_bytes: int = _at_least_0()
    link_bytes_per_s: float = _positive()
    sources: dict[str, str] = field(default_factory=dict)

    def validate(self) -> "CostProfile":
        validate_fields(self, f"profile {self.name}")
        return self

    @property
    def kv_recompute_us_per_token(self) -> float:
        """Mean cost of recomputing one history token at a 1k-token context (router weights)."""
        return self.token_us + self.attn_us_per_ctx * 512

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.kv_bytes_per_token

    @property
    def rows_per_page(self) -> int:
        return max(1, self.page_bytes // self.emb_row_bytes)

    def to_json(self) -> dict:
        return asdict(self)


# --- the default: A100-80GB node, HSTU-scale model -------------------------------------------
# Model: 24 HSTU layers, d_model 1024 (8 heads x 128), bf16 -- the largest dense HSTU stacks in
# Zhai et al. 2024 ("Actions Speak Louder than Words", ICML 2024, Table 5/6 use up to 24 layers
# x 1024) with production sequences of 8k-15k tokens (the RACER paper: "15k+").
_LAYERS, _D, _BF16 = 24, 1024, 2
_A100_BF16_FLOPS = 312e12  # NVIDIA A100 datasheet: 312 TFLOPS dense BF16 tensor core
_MFU = 0.40  # sustained fraction of peak for prefill GEMMs (typical 35-50% in MLPerf-style runs)
# per token per layer: U,V,Q,K projection (d -> 4d) + output (d -> d) = 2 * 5 d^2 FLOPs
_TOKEN_FLOPS = _LAYERS * 2 * 5 * _D * _D
# attention per token per layer and context token: QK^T and AV, 2 * 2 * d FLOPs
_ATTN_FLOPS_PER_CTX = _LAYERS * 4 * _D

A100_HSTU = CostProfile(
    name="a100-hstu",
    token_us=_TOKEN_FLOPS / (_A100_BF16_FLOPS * _MFU) * 1e6,  # ~2.0 µs
    attn_us_per_ctx=_ATTN_FLOPS_PER_CTX / (_A100_BF16_FLOPS * _MFU) * 1e6,  # ~0.0008 µs
    cand_us=_TOKEN_FLOPS / (_A100_BF16_FLOPS * _MFU) * 1e6,
    emb_transfer_us_per_row=16 * 1024 / 12e9 * 1e6,  # 16 KiB row over 12 GB/s effective: ~1.37 µs
    emb_hit_us_per_row=16 * 1024 / (2.0e12 * 0.5) * 1e6,  # HBM2e 2.0 TB/s at 50% for gathers
    batch_overhead_us=150.0,
    request_overhead_us=20.0,
    batch_speedup=4.0,
    max_batch=64,
    emb_row_bytes=16 * 1024,
    kv_bytes_per_token=_LAYERS * 2 * _D * _BF16,  # 96 KiB
    page_tokens=16,
    hbm_cache_bytes=40 * 2**30,
    link_bytes_per_s=12e9,
    sources={
        "token_us": "24 layers x 10 d^2 FLOPs (d=1024) at 40% of A100's 312 TFLOPS BF16 (NVIDIA A100 datasheet); "
                    "HSTU shapes from Zhai et al., ICML 2024",
        "attn_us_per_ctx": "24 layers x 4 d FLOPs per context token at the same rate",
        "emb_transfer_us_per_row": "a 16 KiB item row (32 sparse features x 128 dims x fp32, DLRM-style; Naumov et al. "
                                   "2019) over 12 GB/s: PCIe 4.0 x16 is 31.5 GB/s per direction (PCI-SIG), pinned "
                                   "H2D reaches ~25 GB/s, and a host-side gather of scattered rows about halves it "
                                   "(FBGEMM UVM caching, Khudia et al. 2021)",
        "emb_hit_us_per_row": "HBM2e 2,039 GB/s (A100 80GB datasheet) at 50% for row gathers",
        "batch_overhead_us": "kernel launches of a 24-layer stack (~5 us each, 30 per batch): CUDA launch latency",
        "batch_speedup": "small prefill batches leave SMs idle; overlapping 4 requests' work is a conservative "
                         "middle between serial (1) and a saturated GPU",
        "kv_bytes_per_token": "K and V, 24 layers x 1024 x bf16",
        "page_tokens": "16-token blocks as vLLM's default block size (Kwon et al., SOSP 2023)",
        "hbm_cache_bytes": "half of an A100 80GB's HBM for the two caches; weights and activations take the rest",
        "link_bytes_per_s": "effective host-to-device rate for gathered rows, as above",
    },
).validate()

PROFILES = {A100_HSTU.name: A100_HSTU}


def from_node_profile(path: str | Path, base: CostProfile = A100_HSTU) -> CostProfile:
    """A profile measured by ``racer node profile --json`` (file), over ``base`` for sizes.

    Reads ``kv_recompute_us_per_token`` (a mapping of history length -> µs, or a number),
    ``emb_transfer_us_per_row`` and, when present, ``emb_hit_us_per_row``.
    """
    from node_agent.profile import read_node_profile

    p = Path(path)
    data = read_node_profile(p)
    kv = data["kv_recompute_us_per_token"]
    if isinstance(kv, dict):
        pts = sorted((float(k), float(v)) for k, v in kv.items())
        if len(pts) >= 2:
            (l0, c0), (l1, c1) = pts[0], pts[-1]
            slope = max(0.0, (c1 - c0) / (l1 - l0)) / 2  # mean cost rises by slope/2 per context token
            token = max(1e-6, c0 - slope * l0)
        else:
            token, slope = pts[0][1], 0.0
    else:
        token, slope = float(kv), 0.0
    prof = replace(base, name=str(data.get("name", p.stem)), token_us=token, attn_us_per_ctx=slope, cand_us=token,
                   emb_transfer_us_per_row=float(data["emb_transfer_us_per_row"]),
                   emb_hit_us_per_row=float(data.get("emb_hit_us_per_row", base.emb_hit_us_per_row)),
                   sources={"all": f"measured by racer node profile: {p}"})
    return prof.validate()


def get_profile(name_or_path: str) -> CostProfile:
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if Path(name_or_path).exists():
        return from_node_profile(name_or_path)
    raise ValueError(f"unknown profile {name_or_path!r}: use one of {', '.join(PROFILES)} or a JSON file")


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
        return replace(base, name=f"{base.name}@paper-scale/{1 / self.scale:g}",
                       kv_bytes_per_token=self.kv_bytes_per_token(base), page_tokens=self.page_tokens(base),
                       hbm_cache_bytes=self.scaled_arena_bytes(), link_bytes_per_s=base.link_bytes_per_s * self.scale,
                       sources=dict(base.sources, paper_scale="PaperScale in simulator/profiles.py")).validate()

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
