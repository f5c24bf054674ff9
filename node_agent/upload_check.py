"""An uploaded artifact checked as a node agent loads it, in the child process the control plane
starts with limits (`control_plane.artifacts.check_upload`): ``python -m node_agent.upload_check
KIND DIR`` reads ``DIR/upload`` (the body as received), unpacks it (`common.artifact_pack`: the tar
headers walked first, members and unpacked size bounded), checks it with the node's own loaders (a
policy: `node_agent.allocator.OnnxPolicy`, the ONNX checker, operator allowlist, an ONNX Runtime
session, golden parity; a checkpoint: `node_agent.model.checkpoint.load_checkpoint`, every digest,
the config against the weights, and fit with the active model in ``DIR/active.json``), and writes
the files to ``DIR/out/`` and the manifest to ``DIR/manifest.json``; a refusal's reason goes to
``DIR/error.txt`` (exit 1), an allocation the memory limit refused exits 3. An artifact the control
plane accepts is one a node loads, with no second copy of the checks to drift from them.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

from common.artifact_pack import unpack_artifact, unpack_checkpoint


@contextlib.contextmanager
def _written(files: dict[str, bytes], prefix: str):
    """A temporary directory holding ``files``, for a loader that reads a directory; a ValueError
    raised inside names ``<upload>`` instead of the directory."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        for name, data in files.items():
            (Path(d) / name).write_bytes(data)
        try:
            yield d
        except ValueError as e:
            raise ValueError(str(e).replace(d, "<upload>")) from None


def verify_files(files: dict[str, bytes]) -> dict:
    """Check an artifact as the node agent does before using it (manifest, sha256, onnx.checker,
    I/O names/shapes/types, golden parity, finite probe outputs); returns the manifest."""
    from node_agent.allocator import OnnxPolicy

    with _written(files, "racer-policy-") as d:
        return dict(OnnxPolicy(d, device="cpu").manifest)  # PolicyLoadError is a ValueError


def verify_checkpoint(files: dict[str, bytes], active_manifest: dict | None) -> dict:
    """Load the checkpoint as a node agent does (every digest checked); when a model is active,
    the new one must have its item count, item mapping and model config. Returns the manifest."""
    from node_agent.model.checkpoint import load_checkpoint

    with _written(files, "racer-model-") as d:
        m = dict(load_checkpoint(d).manifest)  # CheckpointError is a ValueError
    if active_manifest is not None:
        a = active_manifest
        if a.get("num_items") != m.get("num_items"):
            raise ValueError(f"trained on {m.get('num_items')} items, the active model (and the nodes serving it) "
                             f"on {a.get('num_items')}: train it on the trace the fleet serves")
        if a.get("item_keys_sha256") != m.get("item_keys_sha256"):
            raise ValueError("its item-id mapping differs from the active model's (another trace or item order)")
        ca, cm = a.get("model_config"), _config(files.get("config.json"))
        if ca is not None and cm is not None and ca != cm:
            raise ValueError(f"its model config differs from the active model's ({cm} vs {ca}): the nodes' memory "
                             "layout holds the active one")
    return m


def _config(raw: bytes | None) -> dict | None:
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return None


def _child(kind: str, d: str) -> int:
    root = Path(d)
    try:
        data = (root / "upload").read_bytes()
        if kind == "policy":
            files = unpack_artifact(data)
            manifest = verify_files(files)
        else:
            active = json.loads((root / "active.json").read_text()) if (root / "active.json").exists() else None
            files = unpack_checkpoint(data)
            manifest = verify_checkpoint(files, active)
    except ValueError as e:
        (root / "error.txt").write_text(str(e))
        return 1
    except MemoryError:
        return 3
    out = root / "out"
    out.mkdir()
    for name, blob in files.items():
        (out / name).write_bytes(blob)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
