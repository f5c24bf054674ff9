"""What a node says when it registers (``POST /api/v1/nodes/register``): its id, advertised
address, device, cost profile (from the agent's miss costs, i.e. ``racer node profile``), policy
version and the time its process started (the control plane counts restarts by it).

The registration sends the device's label as ``device`` and `Engine.device_info` as
``cost_profile["device"]`` (`node_agent.reports.device_info`), so an emulated figure is never
taken for a measured one. The answer's ``last_report_seq`` (the highest sequence number the
control plane stores for the node) raises the spool's counter past it: a node that lost its
state folder never reuses a number.
"""

from __future__ import annotations

import time

from common.contract import MAX_DEVICE_TEXT_CHARS

#: when this process started (wall s): each registration says it, so the control plane counts restarts
PROCESS_STARTED_S = time.time()


def device_memory(engine) -> dict:
    """What the node tells the operators about its device's memory at registration: the
    bookkeeping outside the arena (``metadata_bytes``), and, where the device reports it (CUDA),
    its total and free bytes then (``device_total_bytes``, ``device_free_bytes``). A CPU or an
    emulated device reports no device memory: the keys are absent."""
    out = {}
    mm = getattr(engine, "mm", None)
    if mm is not None and hasattr(mm, "metadata_bytes"):
        out["metadata_bytes"] = int(mm.metadata_bytes())
    dev = getattr(mm, "arena", None) and mm.arena.device
    if dev is not None and getattr(dev, "type", None) == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(dev)
        out.update(device_total_bytes=int(total), device_free_bytes=int(free))
    return out


def cost_profile(miss_costs: dict | None, *, queue_capacity: int, service_time_us: float | None = None,
                 history_len: float = 512.0, num_candidates: int = 256, arena_bytes: int | None = None) -> dict:
    """The cost profile sent at registration (common.weights.CostProfile fields).

    ``kv_recompute_us_per_token`` is the profiled cost at the profiled history length nearest
    ``history_len``; ``service_time_us`` is the given figure, else an estimate of one request's
    full-miss service time: ``history_len * kv + num_candidates * emb`` (the router's load term
    only needs it to scale queue depth into time).
    """
    from .control import cost_at

    costs = miss_costs or {}
    kv = cost_at(costs.get("kv_recompute_us_per_token", 0.0), history_len)
    emb = float(costs.get("emb_transfer_us_per_row", 0.0))
    svc = service_time_us if service_time_us is not None else history_len * kv + num_candidates * emb
    out = {"kv_recompute_us_per_token": float(kv), "emb_transfer_us_per_row": emb,
           "service_time_us": float(max(svc, 0.0)), "queue_capacity": int(queue_capacity)}
    if arena_bytes:  # the arena's size, for the operators (the weights do not use it)
        out["arena_bytes"] = int(arena_bytes)
    return out


def device_label(engine, device: dict | None) -> str:
    """The device as the control plane lists it: `Engine.device_info`'s label
    ("emulated a100-hstu (uncalibrated, modelled time, x10)", "cpu (EMB link emulated)",
    "cuda:0"), else the engine's device."""
    label = (device or {}).get("label") or str(getattr(engine, "device", "unknown"))
    return label[:MAX_DEVICE_TEXT_CHARS]


def registration_profile(agent, device: dict | None, *, queue_capacity: int | None,
                         service_time_us: float | None) -> dict:
    """The cost profile of `cost_profile`, plus the device's memory, the served checkpoint's digest
    and what the node's figures are (``device``: real, link-emulated or emulated, by which profile)."""
    engine = agent.engine
    ecfg = engine.config
    mm = getattr(engine, "mm", None)
    arena = ecfg.num_pages * mm.config.page_bytes if mm is not None and hasattr(ecfg, "num_pages") else None
    prof = cost_profile(agent.miss_costs, queue_capacity=queue_capacity or agent.config.max_queue,
                        service_time_us=service_time_us,
                        num_candidates=getattr(ecfg, "default_num_candidates", 256), arena_bytes=arena)
    prof.update(device_memory(engine))
    digest = (getattr(engine, "model_info", None) or {}).get("digest")
    if digest:  # the checkpoint this node serves, for the operators (random weights: none)
        prof["model_digest"] = digest
    if device is not None:
        prof["device"] = dict(device)
    return prof


def registration_body(agent, config, device: dict | None, policy_version: str | None) -> dict:
    """The body of ``POST /api/v1/nodes/register`` (``config``: the `ReporterConfig`)."""
    return {"node_id": config.node_id, "address": config.advertise_url,
            "device": device_label(agent.engine, device),
            "cost_profile": registration_profile(agent, device, queue_capacity=config.queue_capacity,
                                                 service_time_us=config.service_time_us),
            "policy_version": policy_version, "started_at_s": PROCESS_STARTED_S}
