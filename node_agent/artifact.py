"""The policy artifact's format: file names, the manifest's schema and its checks.

An artifact is a directory:

    policy.onnx     the actor: input ``features`` [batch, NUM_FEATURES] float32 ->
                    output ``emb_share`` [batch, 1] float32 (the mean action, see policies.actor)
    golden.npz      ``inputs`` [N, NUM_FEATURES] and ``outputs`` [N, 1], float32: torch's outputs on
                    the golden inputs, which every runtime must reproduce within the tolerance
    manifest.json   everything needed to accept or refuse the artifact (see `check_manifest`)

This module needs only json, hashlib and numpy: the node agent reads and checks manifests without
importing torch or the exporter. `policies.export` writes artifacts; `node_agent.allocator` loads
them.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from common.ids import id_problem

from .features import FEATURE_NAMES, NUM_FEATURES, SCHEMA_VERSION

MANIFEST_FORMAT = "racer-policy"
MANIFEST_VERSION = 1
ONNX_FILE = "policy.onnx"
GOLDEN_FILE = "golden.npz"
MANIFEST_FILE = "manifest.json"
INPUT_NAME = "features"
OUTPUT_NAME = "emb_share"
PARITY_TOLERANCE = 1e-5
ACTION = {
    "name": "emb_share",
    "kind": "absolute",
    "range": [0.0, 1.0],
    "definition": "mean action: target emb_share = sigmoid(mlp(features)); PPO samples the logit from "
                  "Normal(mlp(features), exp(log_std)) and squashes it with the sigmoid",
}

REQUIRED_KEYS = ("format", "format_version", "policy_id", "feature_schema_version", "feature_names", "action",
                 "inputs", "outputs", "onnx_file", "onnx_sha256", "golden_file", "golden_sha256", "num_golden",
                 "parity", "actor_config", "training_config", "evaluation")


class ArtifactError(ValueError):
    """A policy artifact that must not be used; the message says why."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def io_spec(num_features: int = NUM_FEATURES) -> tuple[list[dict], list[dict]]:
    """The input and output specs a manifest must carry for this schema."""
    inputs = [{"name": INPUT_NAME, "shape": ["batch", num_features], "dtype": "float32"}]
    outputs = [{"name": OUTPUT_NAME, "shape": ["batch", 1], "dtype": "float32"}]
    return inputs, outputs


#: what a policy's graph may use: an MLP's linear algebra and activations. No control flow (Loop,
#: If, Scan), no ops whose output size comes from data (ConstantOfShape, Expand, Tile, Range, ...),
#: no randomness: a policy runs once per control step on the node, and a 40-KB graph with an ONNX
#: Loop once raised a node's P50 from 6 to 2,319 ms.
ALLOWED_OPS = frozenset({"Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Relu", "LeakyRelu", "Tanh", "Sigmoid",
                         "Clip", "Identity", "Softplus", "Elu", "Selu", "Neg", "Abs", "Min", "Max", "Flatten"})
MAX_GRAPH_NODES = 256
MAX_GRAPH_ELEMENTS = 4 * 2**20  # weights and constants, all together (16 MB of float32)


def check_graph(model) -> list[str]:
    """Every reason an ONNX ``model`` (an ``onnx.ModelProto``) is not a policy this runtime runs:
    ops outside `ALLOWED_OPS`, subgraphs, more than `MAX_GRAPH_NODES` nodes, or weights and
    constants past `MAX_GRAPH_ELEMENTS` elements."""
    import onnx

    g = model.graph
    problems = []
    bad = sorted({f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in g.node
                  if n.domain not in ("", "ai.onnx") or n.op_type not in ALLOWED_OPS})
    if bad:
        problems.append(f"operators outside a policy's allowlist: {', '.join(bad[:10])} "
                        f"(allowed: {', '.join(sorted(ALLOWED_OPS))})")
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for a in n.attribute):
        problems.append("a subgraph (control flow) in the graph")
    if len(g.node) > MAX_GRAPH_NODES:
        problems.append(f"{len(g.node)} nodes (at most {MAX_GRAPH_NODES})")
    elements = 0
    for t in g.initializer:
        n = 1
        for d in t.dims:
            n *= max(int(d), 0)
        elements += n
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                n = 1
                for d in a.t.dims:
                    n *= max(int(d), 0)
                elements += n
    if elements > MAX_GRAPH_ELEMENTS:
        problems.append(f"{elements} weight and constant elements (at most {MAX_GRAPH_ELEMENTS})")
    return problems


def check_manifest(manifest: object, schema: int = SCHEMA_VERSION, feature_names=FEATURE_NAMES) -> list[str]:
    """Every reason ``manifest`` (a parsed manifest.json) is unacceptable to this code base.
    ``schema`` / ``feature_names``: the feature schema expected (default: this runtime's; an older
    schema's when an artifact is read to be widened, `policies.train_ppo.load_policy_weights`)."""
    if not isinstance(manifest, dict):
        return [f"manifest must be a JSON object, got {type(manifest).__name__}"]
    problems = [f"manifest lacks {k!r}" for k in REQUIRED_KEYS if k not in manifest]
    if problems:
        return problems
    why = id_problem(manifest["policy_id"], "policy_id")
    if why:
        problems.append(why)
    if manifest["format"] != MANIFEST_FORMAT:
        problems.append(f"format is {manifest['format']!r}, expected {MANIFEST_FORMAT!r}")
    if manifest["format_version"] != MANIFEST_VERSION:
        problems.append(f"format_version is {manifest['format_version']!r}, expected {MANIFEST_VERSION}")
    if manifest["feature_schema_version"] != schema:
        problems.append(f"feature schema version {manifest['feature_schema_version']!r} does not match this "
                        f"runtime's {schema}")
    elif manifest["feature_names"] != list(feature_names):
        problems.append(f"feature_names {manifest['feature_names']!r} differ from schema {schema}'s "
                        f"{list(feature_names)!r}")
    inputs, outputs = io_spec(len(feature_names))
    if manifest["inputs"] != inputs:
        problems.append(f"inputs {manifest['inputs']!r}, expected {inputs!r}")
    if manifest["outputs"] != outputs:
        problems.append(f"outputs {manifest['outputs']!r}, expected {outputs!r}")
    action = manifest["action"]
    if not (isinstance(action, dict) and action.get("name") == "emb_share" and action.get("kind") == "absolute"):
        problems.append(f"action {manifest['action']!r} is not the absolute emb_share action")
    for key in ("onnx_sha256", "golden_sha256"):
        v = manifest[key]
        if not (isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)):
            problems.append(f"{key} must be 64 lowercase hex digits, got {v!r}")
    for key in ("onnx_file", "golden_file"):
        v = manifest[key]
        if not (isinstance(v, str) and v and "/" not in v and "\\" not in v and v not in (".", "..")):
            problems.append(f"{key} must be a plain file name inside the artifact, got {v!r}")
    parity = manifest["parity"]
    if not isinstance(parity, dict) or parity.get("passed") is not True:
        problems.append(f"parity did not pass at export: {parity!r}")
    else:
        tol = parity.get("tolerance")
        if not (isinstance(tol, (int, float)) and not isinstance(tol, bool) and math.isfinite(tol) and 0 < tol <= 1e-3):
            problems.append(f"parity tolerance must be in (0, 1e-3], got {tol!r}")
    n = manifest["num_golden"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        problems.append(f"num_golden must be an integer >= 1, got {n!r}")
    return problems


def read_manifest(artifact_dir: str | Path) -> dict:
    """Parse and check ``artifact_dir/manifest.json``; raise `ArtifactError` listing the problems."""
    path = Path(artifact_dir) / MANIFEST_FILE
    if not Path(artifact_dir).is_dir():
        raise ArtifactError(f"{artifact_dir}: not a policy artifact directory")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable manifest: {e}") from None
    problems = check_manifest(manifest)
    if problems:
        raise ArtifactError(f"{path}: " + "; ".join(problems))
    return manifest


def read_onnx_bytes(artifact_dir: str | Path, manifest: dict) -> bytes:
    """The ONNX file's bytes, after checking them against the manifest's sha256."""
    path = Path(artifact_dir) / manifest["onnx_file"]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read the ONNX file: {e}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != manifest["onnx_sha256"]:
        raise ArtifactError(f"{path}: sha256 {digest} does not match the manifest's {manifest['onnx_sha256']} "
                            "(corrupt or replaced file)")
    return data


def read_golden(artifact_dir: str | Path, manifest: dict, num_features: int = NUM_FEATURES) -> tuple[np.ndarray, np.ndarray]:
    """The golden ``(inputs [N, F], outputs [N, 1])`` after checking sha256, shapes and dtypes
    (``F = num_features``: this schema's, or an older schema's for an artifact read to be widened)."""
    path = Path(artifact_dir) / manifest["golden_file"]
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read the golden set: {e}") from None
    if digest != manifest["golden_sha256"]:
        raise ArtifactError(f"{path}: sha256 {digest} does not match the manifest's {manifest['golden_sha256']}")
    try:
        with np.load(path, allow_pickle=False) as z:
            inputs, outputs = z["inputs"], z["outputs"]
    except (OSError, KeyError, ValueError) as e:
        raise ArtifactError(f"{path}: unreadable golden set: {e}") from None
    n = manifest["num_golden"]
    if inputs.dtype != np.float32 or inputs.shape != (n, num_features):
        raise ArtifactError(f"{path}: golden inputs are {inputs.dtype} {inputs.shape}, expected float32 "
                            f"({n}, {num_features})")
    if outputs.dtype != np.float32 or outputs.shape != (n, 1):
        raise ArtifactError(f"{path}: golden outputs are {outputs.dtype} {outputs.shape}, expected float32 ({n}, 1)")
    return inputs, outputs


def probe_inputs(num_random: int = 32, seed: int = 12345) -> np.ndarray:
    """Inputs every accepted policy must answer with a finite emb_share in [0, 1]: each feature's
    low and high ends, the midpoint, and ``num_random`` uniform points of the feature box."""
    from .features import FEATURE_HIGH, FEATURE_LOW

    rng = np.random.default_rng(seed)
    rand = FEATURE_LOW + (FEATURE_HIGH - FEATURE_LOW) * rng.random((num_random, NUM_FEATURES), dtype=np.float32)
    rows = [FEATURE_LOW, FEATURE_HIGH, (FEATURE_LOW + FEATURE_HIGH) / 2, np.zeros(NUM_FEATURES, np.float32)]
    return np.concatenate([np.stack(rows), rand]).astype(np.float32)


def check_outputs(outputs: np.ndarray, what: str) -> None:
    """Refuse non-finite outputs or outputs outside [0, 1], naming the first offending row."""
    flat = np.asarray(outputs, dtype=np.float64).reshape(len(outputs), -1)
    bad = ~np.isfinite(flat).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ArtifactError(f"policy outputs non-finite values ({flat[i].tolist()}) on {what} row {i} "
                            f"({int(bad.sum())} of {len(flat)} rows)")
    out = (flat < 0) | (flat > 1)
    if out.any():
        i = int(np.flatnonzero(out.any(axis=1))[0])
        raise ArtifactError(f"policy outputs emb_share {flat[i].tolist()} outside [0, 1] on {what} row {i}")
