"""Policies for ``racer up``'s first minutes: the shipped policy registered and active in the
control plane, and a second, different candidate registered beside it, so that an operator can
start a rollout (canary, promote, roll back) from the dashboard at once.

The candidate is derived from the shipped artifact in well under a second, without torch: the
same network with its output logit moved by `CANDIDATE_LOGIT_SHIFT` (``head.bias``), so it proposes
a smaller ``emb_share`` (more of the arena to the KV pool) for the same features. Its golden outputs
are onnxruntime's on the shipped golden inputs, its manifest says what it was derived from, and it
is checked with the node agent's own loader (`OnnxPolicy`) before it is used. It lives in
``DATA/policies/candidate-<shipped policy_id>/`` and is reused by later runs (same bytes, same
policy_id). Uploading is idempotent (the registry answers 200 for a known digest), and the shipped
policy is activated only while no policy is active, so an operator's choice survives a restart.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from common.ids import path_segment

CANDIDATE_LOGIT_SHIFT = -1.0
_OUTPUT_BIAS = "head.bias"  # the last Gemm's bias, before the sigmoid that gives emb_share


def derive_candidate(shipped: Path, out_dir: Path, logit_shift: float = CANDIDATE_LOGIT_SHIFT) -> dict:
    """Write (or reuse) the candidate derived from the ``shipped`` artifact in ``out_dir``; return
    its manifest. Raises ValueError when the shipped network has no ``head.bias`` to move, and
    `PolicyLoadError` when the result does not pass the agent's loader."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from node_agent.allocator.base import OnnxPolicy

    if (out_dir / "manifest.json").exists():
        try:
            return dict(OnnxPolicy(out_dir, device="cpu").manifest)
        except Exception:  # noqa: BLE001 - a damaged copy: derive it again
            shutil.rmtree(out_dir, ignore_errors=True)
    src = json.loads((shipped / "manifest.json").read_text())
    model = onnx.load(str(shipped / src["onnx_file"]))
    bias = [t for t in model.graph.initializer if t.name == _OUTPUT_BIAS]
    if len(bias) != 1:
        raise ValueError(f"{shipped}: no single {_OUTPUT_BIAS!r} initializer to derive a candidate from")
    moved = numpy_helper.to_array(bias[0]).astype(np.float32) + np.float32(logit_shift)
    bias[0].CopyFrom(numpy_helper.from_array(moved, _OUTPUT_BIAS))
    onnx_bytes = model.SerializeToString()
    with np.load(shipped / src["golden_file"]) as g:
        inputs = g["inputs"].astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])
    outputs = sess.run(None, {sess.get_inputs()[0].name: inputs})[0].astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, inputs=inputs, outputs=outputs)
    golden_bytes = buf.getvalue()
    onnx_sha = hashlib.sha256(onnx_bytes).hexdigest()
    manifest = {**src, "policy_id": onnx_sha[:12], "onnx_sha256": onnx_sha, "onnx_bytes": len(onnx_bytes),
                "golden_sha256": hashlib.sha256(golden_bytes).hexdigest(), "source": str(shipped),
                "parity": {**src.get("parity", {}), "max_abs_diff": 0.0, "passed": True,
                           "provider": "CPUExecutionProvider",
                           "reference": "onnxruntime (derived from the shipped ONNX; no torch model)"},
                "derived_from": {"policy_id": src["policy_id"], "change": f"{_OUTPUT_BIAS} {logit_shift:+g} "
                                 f"(the emb_share logit: a smaller emb_share for the same features)",
                                 "by": "racer up"},
                "evaluation": {"skipped": "a candidate derived by racer up to try a rollout with; not trained "
                                          "or judged"}}
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / src["onnx_file"]).write_bytes(onnx_bytes)
    (tmp / src["golden_file"]).write_bytes(golden_bytes)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    OnnxPolicy(tmp, device="cpu")  # the agent's loader accepts it, or this raises
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return manifest


def artifact_tar(artifact_dir: Path) -> bytes:
    """The artifact's files as one tar (the body ``POST /api/v1/policies`` takes): the control
    plane's canonical tar (`pack_artifact`), so the same files give the same bytes."""
    from common.artifact_pack import ARTIFACT_FILES, pack_artifact

    return pack_artifact({name: (artifact_dir / name).read_bytes() for name in ARTIFACT_FILES})


def upload(api: str, token: str, artifact_dir: Path, *, timeout_s: float = 60.0) -> tuple[str, str]:
    """Register an artifact (idempotent: a known digest answers 200, with its status now);
    returns (version, status)."""
    import httpx

    r = httpx.post(f"{api}/policies", content=artifact_tar(artifact_dir), timeout=timeout_s,
                   headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-tar"})
    if r.status_code not in (200, 201):
        raise RuntimeError(f"POST /policies ({artifact_dir}) answered {r.status_code}: {r.text[:300]}")
    d = r.json()
    return str(d["version"]), str(d.get("status") or "registered")


def seed_policies(cp_url: str, token: str, shipped: Path, data_dir: Path,
                  log: Callable[[str], None]) -> dict:
    """Register ``shipped`` and its derived candidate; activate ``shipped`` if no policy is active.
    Returns what was done, with the time each step took.

    The activation is check-then-act (``GET /policies``, then ``POST .../activate``; the API has no
    conditional activate): an operator who activates another policy between the two calls (or a
    second racer up on the same database) is overridden by the shipped one. The window is one
    round trip at start-up; the audit log records both activations, and the operator's choice can
    be made again from the dashboard."""
    api = f"{cp_url}/api/v1"
    t0 = time.monotonic()
    out: dict = {}
    shipped_version, _ = upload(api, token, shipped)
    out["shipped"], out["upload_s"] = shipped_version, round(time.monotonic() - t0, 2)
    out.update(activate_unless_one_is(api, token, "policies", shipped_version,
                                      "racer up: the shipped policy, active from the start"))
    t1 = time.monotonic()
    candidate_dir = data_dir / "policies" / f"candidate-{shipped_version}"
    manifest = derive_candidate(shipped, candidate_dir)
    out["derive_s"] = round(time.monotonic() - t1, 2)
    out["candidate"], status = upload(api, token, candidate_dir)
    out["candidate_status"] = status
    out["candidate_dir"] = str(candidate_dir)
    out["total_s"] = round(time.monotonic() - t0, 2)
    ready = ", ready for a rollout from the dashboard's policies tab" if status == "registered" else ""
    log(f"policies: {out['active']} active{' (the shipped one)' if out['active'] == shipped_version else ''}; "
        f"candidate {out['candidate']} {status} ({manifest['derived_from']['change'].split(' (')[0]} of "
        f"{shipped_version}){ready} ({out['total_s']:g} s)")
    return out


def seed_model(cp_url: str, token: str, model_dir: Path, log: Callable[[str], None]) -> dict:
    """Register the checkpoint every node serves (``model_dir``) in the model registry and activate
    it while no model is active, so the registry holds what the fleet runs and a model rollout has
    its baseline from the start (an operator's active model survives a restart)."""
    import httpx

    from common.artifact_pack import CHECKPOINT_FILES, pack_directory

    api = f"{cp_url}/api/v1"
    t0 = time.monotonic()
    r = httpx.post(f"{api}/models", content=pack_directory(model_dir, CHECKPOINT_FILES), timeout=120.0,
                   headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-tar"})
    if r.status_code not in (200, 201):
        raise RuntimeError(f"POST /models ({model_dir}) answered {r.status_code}: {r.text[:300]}")
    version = str(r.json()["version"])
    out = {"model": version, **activate_unless_one_is(
        api, token, "models", version, "racer up: the checkpoint every node serves, active from the start")}
    out["total_s"] = round(time.monotonic() - t0, 2)
    log(f"model: {out['active']} active{' (the one the nodes serve)' if out['active'] == version else ''}")
    return out


def activate_unless_one_is(api: str, token: str, kind: str, version: str, reason: str) -> dict:
    """``{"active": ...}``: the registry's (``kind``: "policies" or "models") active version, or
    ``version`` activated now (``"activated": True``) when none is, so an operator's choice
    survives a restart. Check-then-act (the API has no conditional activate): see `seed_policies`."""
    import httpx

    auth = {"Authorization": f"Bearer {token}"}
    active = [str(x["version"]) for x in httpx.get(f"{api}/{kind}", headers=auth, timeout=30.0).json()
              if x.get("status") == "active"]
    if active:
        return {"active": active[0]}
    r = httpx.post(f"{api}/{kind}/{path_segment(version)}/activate", headers=auth, timeout=30.0,
                   json={"reason": reason})
    if r.status_code != 200:
        raise RuntimeError(f"activating {kind} {version} answered {r.status_code}: {r.text[:300]}")
    return {"active": version, "activated": True}
