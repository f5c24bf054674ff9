"""The device model: what a node's time and memory cost, shared by the simulator and the
emulated node agent (one definition, so both charge the same durations).

**Profiles** (`CostProfile`): the per-unit costs of the cost model and the byte sizes that turn
a node's HBM budget into EMB rows and KV tokens. The preset `A100_HSTU` is an A100-class node
serving an HSTU-scale model; each figure carries its public source or the arithmetic that
derives it, and it is ``calibrated=False``: no device run has measured it. `from_node_profile`
reads a profile measured by ``racer node profile --json``; it is calibrated only when measured
on a CUDA device with no emulated part (a CPU run with an emulated link is not a GPU's figure).

The sample traces in ../shared/data are tiny next to the paper's setting (tables of TBs, 1 M+
users, histories to 15k tokens), so the simulator does not copy the A100's 40 GB cache budget: it
sizes each node's cache from the workload (``SimConfig.cache_fraction`` of the catalogue's
bytes), keeping the profile's *relative* costs (bytes per KV token vs per embedding row, µs per
recomputed token vs per transferred row), which is what decides the split.

**The cost model** (`request_compute_us`, `batch_duration_us`, ...):

For a request with history length ``L``, ``c`` history tokens whose K/V the node holds, ``n``
new items and ``N`` candidates (``a = token_us``, ``b = attn_us_per_ctx``):

- prefill of the ``T = L + n - c`` tokens at positions ``c .. L+n-1``:
  ``sum_p (a + b p) = a T + b T (c + L + n - 1) / 2`` (a KV miss has ``c = 0``: the whole
  history is recomputed);
- ranking: ``N (cand_us + b (L + n))`` (each candidate attends to the whole sequence);
- compute of the request ``= prefill + ranking``.

A micro-batch of requests ``i`` whose embedding lookup (one call for the batch) had ``M`` distinct
misses and ``H`` hits takes

    batch_overhead_us + R request_overhead_us + M emb_transfer_us_per_row + H emb_hit_us_per_row
      + max(max_i compute_i, sum_i compute_i / batch_speedup)

Transfers are serial on the host link; compute overlaps up to ``batch_speedup`` requests'
worth (a GPU batching small prefills) but a batch never runs faster than its largest request.

A batch that holds several requests of one user is served as the node agent serves it
(`node_agent.engine`): in successive passes, the k-th request of each user in pass k (the second
reads the K/V the first appended). The first pass is the formula above over the batch's first
requests of each user (with every request's overhead and the batch's one embedding lookup); each
later pass adds ``batch_overhead_us + max(max_i compute_i, sum_i compute_i / batch_speedup)``
over its own requests (`extra_passes_us`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from common.config import ranged
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
    # True only for a profile measured on the device it describes (a preset is derived, not measured)
    calibrated: bool = False

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


REQUIRED_PROFILE_KEYS = ("kv_recompute_us_per_token", "emb_transfer_us_per_row")


def read_node_profile(path) -> dict:
    """The JSON object a ``racer node profile --out FILE`` run wrote, checked for the miss-cost
    keys every reader needs (the node agent's allocator, the simulator's cost profile)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"profile file not found: {p}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e})") from None
    if not isinstance(data, dict) or any(k not in data for k in REQUIRED_PROFILE_KEYS):
        raise ValueError(f"{p}: a node profile needs {' and '.join(REQUIRED_PROFILE_KEYS)} "
                         "(write one with racer node profile)")
    return data


def measured_provenance(data: dict) -> tuple[str, bool]:
    """What a measured profile's figures are: a label for its name and whether it is calibrated.

    A profile is calibrated only when measured on a CUDA device with nothing emulated. A CPU
    run is the CPU's figure; one with an emulated link (``link_emulated``) charged its EMB misses
    from a link model; one measured on an emulated agent (``emulated``) is the preset it emulated."""
    emu = data.get("emulated")
    if emu:
        name = emu.get("profile") if isinstance(emu, dict) else emu
        return f"emulated:{name}", False
    device = str(data.get("device", ""))
    parts = [("cuda" if device.startswith("cuda") else "cpu") if device else "unknown-device"]
    if data.get("link_emulated"):
        parts.append("link-emulated")
    return "+".join(parts), device.startswith("cuda") and not data.get("link_emulated")


#: the words a derived profile's ``sources`` start with: where each field's figure came from
ORIGINS = ("measured", "emulated", "assumed")


def from_node_profile(path: str | Path, base: CostProfile = A100_HSTU) -> CostProfile:
    """A profile measured by ``racer node profile --json`` (file), over ``base`` for the rest.

    Reads ``kv_recompute_us_per_token`` (a mapping of history length -> µs, or a number),
    ``emb_transfer_us_per_row`` and, when present, ``emb_hit_us_per_row``. The name says how it
    was measured (`measured_provenance`: ``node-cpu [cpu+link-emulated]``), so a CPU figure or an
    emulated link is never taken for a GPU's. ``sources`` says where each field came from, in
    words that start with one of `ORIGINS`: ``measured ...`` (this file's figure), ``emulated
    ...`` (a figure of an emulated agent, or an EMB miss whose link time a link model charged),
    or ``assumed ...``: ``assumed from <base>`` for the base profile's figures it keeps (the
    batching and overhead figures, ``max_batch`` and every size), ``assumed equal to token_us``
    for ``cand_us``."""
    p = Path(path)
    data = read_node_profile(p)
    kv = data["kv_recompute_us_per_token"]
    lengths: list[float] = []
    if isinstance(kv, dict):
        pts = sorted((float(k), float(v)) for k, v in kv.items())
        lengths = [x for x, _ in pts]
        if len(pts) >= 2:
            # a prefill of L tokens from nothing costs a L + b L (L - 1) / 2 (the module docstring):
            # a + b (L - 1) / 2 per token, a line in L of slope b / 2 through the shortest and longest
            (l0, c0), (l1, c1) = pts[0], pts[-1]
            slope = max(0.0, 2 * (c1 - c0) / (l1 - l0))
            token = max(1e-6, c0 - slope * (l0 - 1) / 2)
        else:
            token, slope = pts[0][1], 0.0
    else:
        token, slope = float(kv), 0.0
    how, calibrated = measured_provenance(data)
    prof = replace(base, name=f"{data.get('name', p.stem)} [{how}]", token_us=token, attn_us_per_ctx=slope,
                   cand_us=token, emb_transfer_us_per_row=float(data["emb_transfer_us_per_row"]),
                   emb_hit_us_per_row=float(data.get("emb_hit_us_per_row", base.emb_hit_us_per_row)),
                   calibrated=calibrated, sources=_node_profile_sources(data, p, base, how, lengths))
    return prof.validate()


def _node_profile_sources(data: dict, path: Path, base: CostProfile, how: str, lengths: list[float]) -> dict:
    """Where each field of `from_node_profile`'s profile came from (see its docstring)."""
    kind = "emulated" if data.get("emulated") else "measured"
    by = f"by racer node profile ({how}), {path}"
    lens = ", ".join(f"{x:g}" for x in lengths) or "one figure"
    out = {f.name: f"assumed from {base.name}" + (f": {base.sources[f.name]}" if f.name in base.sources else "")
           for f in fields(CostProfile) if f.name not in ("name", "sources", "calibrated")}
    line = f"kv_recompute_us_per_token = a + b (L - 1) / 2 fitted through history lengths {lens}"
    out["token_us"] = f"{kind} {by}: a, of {line}"
    out["attn_us_per_ctx"] = (f"{kind} {by}: b, of {line}" if len(lengths) >= 2
                              else f"assumed 0: {kind} at one history length only")
    out["cand_us"] = (f"assumed equal to token_us ({kind}): a candidate costs one history token, as in "
                      f"{base.name}; rank_us_per_candidate is not read")
    if data.get("link_emulated") and kind == "measured":
        out["emb_transfer_us_per_row"] = (f"emulated link over a measured gather {by}: emb_link_us_per_row "
                                          "from the link model (link_emulation) plus the gather's measured time")
    else:
        out["emb_transfer_us_per_row"] = f"{kind} {by}"
    if "emb_hit_us_per_row" in data:
        out["emb_hit_us_per_row"] = f"{kind} {by}"
    return out


def cost_profile_json(path: str | Path) -> CostProfile | None:
    """A whole `CostProfile` written as JSON (``CostProfile.to_json``; e.g. a preset under the
    paper-scale model), or None when the file is another kind of JSON (a node profile)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e})") from None
    if not isinstance(data, dict) or "token_us" not in data:
        return None
    names = {f.name for f in fields(CostProfile)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{p}: not a cost profile: unknown keys {unknown}")
    for key, kind in (("name", str), ("calibrated", bool), ("sources", dict)):
        if key in data and not isinstance(data[key], kind):
            raise ValueError(f"{p}: {key} must be a JSON {kind.__name__}, got {data[key]!r}")
    try:
        return CostProfile(**data).validate()
    except TypeError as e:
        raise ValueError(f"{p}: not a cost profile ({e})") from None


def get_profile(name_or_path: str) -> CostProfile:
    """A preset by name (`PROFILES`), a `CostProfile` JSON file, or a ``racer node profile`` JSON file."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if Path(name_or_path).is_file():
        return cost_profile_json(name_or_path) or from_node_profile(name_or_path)
    raise ValueError(f"unknown profile {name_or_path!r}: use one of {', '.join(PROFILES)} or a JSON file")


# ------------------------------------------------------------------------------ cost model ---


def request_compute_us(prof: CostProfile, cached: np.ndarray, history_len: np.ndarray, num_new: np.ndarray,
                       num_candidates: np.ndarray) -> np.ndarray:
    """Compute time (µs) of each request; arguments are equal-length integer arrays."""
    c = cached.astype(np.float64)
    L = history_len.astype(np.float64)
    n = num_new.astype(np.float64)
    t = L + n - c
    prefill = prof.token_us * t + prof.attn_us_per_ctx * t * (c + L + n - 1) / 2
    rank = num_candidates * (prof.cand_us + prof.attn_us_per_ctx * (L + n))
    return prefill + rank


def batch_time_us(prof: CostProfile, compute_us: np.ndarray, num_unique_misses: int, num_hits: int) -> float:
    """Duration (µs) of a micro-batch; see the module docstring."""
    if len(compute_us) == 0:
        return 0.0
    return batch_duration_us(prof, len(compute_us), float(compute_us.max()), float(compute_us.sum()),
                             num_unique_misses, num_hits)


def batch_duration_us(prof: CostProfile, num_requests: int, max_compute_us: float, sum_compute_us: float,
                      num_unique_misses: int, num_hits: int) -> float:
    """`batch_time_us` from the batch's largest and total request compute."""
    comp = max(max_compute_us, sum_compute_us / prof.batch_speedup)
    return (prof.batch_overhead_us + num_requests * prof.request_overhead_us
            + num_unique_misses * prof.emb_transfer_us_per_row + num_hits * prof.emb_hit_us_per_row + comp)


def user_passes(batch_of: np.ndarray, users: np.ndarray) -> np.ndarray:
    """The pass each request is served in: how many earlier requests (in the given order) of its
    user its batch holds. ``batch_of``/``users``: per request, its batch and its user."""
    n = len(users)
    out = np.zeros(n, dtype=np.int64)
    if n < 2:
        return out
    order = np.lexsort((np.arange(n), users, batch_of))  # by batch, then user, then arrival
    b, u = batch_of[order], users[order]
    first = np.flatnonzero(np.r_[True, (b[1:] != b[:-1]) | (u[1:] != u[:-1])])
    out[order] = np.arange(n) - np.repeat(first, np.diff(np.r_[first, n]))
    return out


def extra_passes_us(prof: CostProfile, compute_us: np.ndarray, passes: np.ndarray) -> float:
    """What a batch's passes after its first add (its requests with ``passes >= 1``): each pass
    ``batch_overhead_us + max(max compute, sum compute / batch_speedup)`` over its own requests."""
    total = 0.0
    for k in range(1, int(passes.max()) + 1 if len(passes) else 1):  # every pass up to the last has a request
        c = compute_us[passes == k]
        total += prof.batch_overhead_us + max(float(c.max()), float(c.sum()) / prof.batch_speedup)
    return total
