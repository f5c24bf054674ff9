"""Trained-model checkpoints: one directory a node agent can serve (``racer node-agent --model DIR``).

A checkpoint directory holds

- ``weights.pt``: a flat dict of tensors (``torch.save``; read back with ``weights_only=True``,
  so loading runs no pickled code): the `HSTUModel` state dict under ``model.<name>`` and the item
  table ``item_embeddings`` ``[num_items, embedding_dim]`` (what the node's EMB cache serves; the
  model itself holds no item rows). The item table may be stored as float16 to halve the file;
  it is served as float32.
- ``config.json``: the `ModelConfig`.
- ``items.json``: the item-id mapping: ``item_keys[i]`` is the source's id of dense item ``i``
  (the trace loaders' ids: first appearance in the file), and its digest.
- ``figures.json``: the training figures (loss and validation metrics per epoch, the test figures).
- ``manifest.json``: format, the files' SHA-256, ``num_items``, the item-keys digest, the trace it
  was trained on, the training config, and ``digest``: SHA-256 over the three files' digests, the
  checkpoint's identity (what a node reports as the model it serves).

`load_checkpoint` checks everything before anything is used: the format, each file's digest,
that the config validates and equals the weights' shapes, and, when given, that the item count
and the item keys equal the serving trace's. Any mismatch raises `CheckpointError` (a
``ValueError``) naming what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .hstu import HSTUModel, ModelConfig

FORMAT = "racer-gr-checkpoint/1"
WEIGHTS_FILE = "weights.pt"
CONFIG_FILE = "config.json"
ITEMS_FILE = "items.json"
FIGURES_FILE = "figures.json"
MANIFEST_FILE = "manifest.json"
_DIGESTED = (WEIGHTS_FILE, CONFIG_FILE, ITEMS_FILE)
MAX_MANIFEST_BYTES = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be served here; the message says what differs."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def item_keys_digest(item_keys: list[str]) -> str:
    """SHA-256 of the item keys in dense-id order (one per line)."""
    h = hashlib.sha256()
    for k in item_keys:
        h.update(str(k).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def combined_digest(file_digests: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{n}:{file_digests[n]}\n" for n in _DIGESTED).encode()).hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model (eval mode, frozen), the item table, the mapping, the manifest."""

    path: str
    config: ModelConfig
    model: HSTUModel
    item_table: torch.Tensor  # float32 [num_items, embedding_dim], host memory
    item_keys: list[str]
    manifest: dict

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def num_items(self) -> int:
        return int(self.item_table.shape[0])

    def summary(self) -> dict:
        """What a node says about the model it serves."""
        m = self.manifest
        return {"digest": m["digest"], "path": self.path, "num_items": self.num_items,
                "config": asdict(self.config), "trace": m.get("trace", {}).get("name"),
                "test": m.get("test")}


def save_checkpoint(out_dir: str | os.PathLike, model: HSTUModel, item_table: torch.Tensor, item_keys: list[str],
                    *, trace: dict | None = None, train: dict | None = None, figures: dict | None = None,
                    test: dict | None = None, item_dtype: str = "float32") -> dict:
    """Write a checkpoint directory (files replaced atomically); returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    if tuple(item_table.shape) != (len(item_keys), cfg.embedding_dim):
        raise ValueError(f"item table {list(item_table.shape)} does not match {len(item_keys)} items x "
                         f"{cfg.embedding_dim}")
    if item_dtype not in ("float32", "float16"):
        raise ValueError(f"item_dtype must be float32 or float16, got {item_dtype!r}")
    tensors = {f"model.{k}": v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    tensors["item_embeddings"] = item_table.detach().to("cpu", getattr(torch, item_dtype)).contiguous()
    tmp = out / (WEIGHTS_FILE + ".tmp")
    torch.save(tensors, tmp)
    os.replace(tmp, out / WEIGHTS_FILE)
    _write_json(out / CONFIG_FILE, asdict(cfg))
    keys_digest = item_keys_digest(item_keys)
    _write_json(out / ITEMS_FILE, {"num_items": len(item_keys), "item_keys_sha256": keys_digest,
                                   "item_keys": [str(k) for k in item_keys]})
    _write_json(out / FIGURES_FILE, figures or {})
    files = {n: sha256_file(out / n) for n in _DIGESTED}
    manifest = {"format": FORMAT, "digest": combined_digest(files), "files": files,
                "num_items": len(item_keys), "item_keys_sha256": keys_digest, "item_dtype": item_dtype,
                "config": asdict(cfg), "trace": trace or {}, "train": train or {}, "test": test or {}}
    _write_json(out / MANIFEST_FILE, manifest)
    return manifest


def _read_json(path: Path, what: str, limit: int | None = None) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path.parent}: no {path.name} ({what})")
    if limit is not None and path.stat().st_size > limit:
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is larger than {limit} bytes")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} is not JSON ({e})") from None


def config_from_dict(d: Any, where: str) -> ModelConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: the model config must be an object")
    names = {f.name for f in fields(ModelConfig)}
    extra = sorted(set(d) - names)
    if extra:
        raise CheckpointError(f"{where}: unknown model config keys {extra}")
    try:
        return ModelConfig(**d).validate()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: bad model config ({e})") from None


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of checkpoint directory ``path`` (format checked, files not yet verified)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p}: no such directory")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p}: not a directory (a checkpoint is a directory with {MANIFEST_FILE})")
    m = _read_json(p / MANIFEST_FILE, "the manifest", MAX_MANIFEST_BYTES)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise CheckpointError(f"checkpoint {p}: format {got!r}, expected {FORMAT!r}")
    return m


def load_checkpoint(path: str | os.PathLike, *, item_keys: list[str] | None = None, num_items: int | None = None,
                    config: ModelConfig | None = None, digest: str | None = None,
                    item_keys_sha256: str | None = None) -> Checkpoint:
    """Read and verify checkpoint ``path``; optional expectations: the serving trace's item keys
    (or just its ``num_items``, and the keys' `item_keys_digest` as ``item_keys_sha256`` where the
    caller holds only that), the model config the node runs (shapes its memory layout holds), a
    digest. Raises `CheckpointError` naming the first thing that does not match."""
    p = Path(path)
    m = read_manifest(p)
    files = m.get("files")
    if not isinstance(files, dict) or any(not isinstance(files.get(n), str) for n in _DIGESTED):
        raise CheckpointError(f"checkpoint {p}: the manifest lists no digests for {', '.join(_DIGESTED)}")
    for n in _DIGESTED:
        if not (p / n).is_file():
            raise CheckpointError(f"checkpoint {p}: {n} is missing")
        got = sha256_file(p / n)
        if got != files[n]:
            raise CheckpointError(f"checkpoint {p}: {n} has digest {got[:12]}.., the manifest says "
                                  f"{files[n][:12]}..: the file changed after the checkpoint was written")
    if combined_digest(files) != m.get("digest"):
        raise CheckpointError(f"checkpoint {p}: the manifest's digest does not match its files' digests")
    if digest is not None and m["digest"] != digest:
        raise CheckpointError(f"checkpoint {p}: digest {m['digest'][:12]}.., expected {digest[:12]}..")
    cfg = config_from_dict(_read_json(p / CONFIG_FILE, "the model config"), f"checkpoint {p}")
    if config is not None and cfg != config:
        diff = {k: (getattr(cfg, k), getattr(config, k)) for k in asdict(cfg) if getattr(cfg, k) != getattr(config, k)}
        raise CheckpointError(f"checkpoint {p}: its model config differs from the one served here "
                              f"(checkpoint vs served: {diff})")
    items = _read_json(p / ITEMS_FILE, "the item-id mapping")
    keys = items.get("item_keys") if isinstance(items, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointError(f"checkpoint {p}: {ITEMS_FILE} has no list of item keys")
    if num_items is not None and len(keys) != num_items:
        raise CheckpointError(f"checkpoint {p}: trained on {len(keys)} items, the trace served here has "
                              f"{num_items}: train the model on this trace (racer model train) or serve the "
                              f"trace it was trained on ({m.get('trace', {}).get('path', '?')})")
    if item_keys is not None:
        if len(keys) != len(item_keys):
            raise CheckpointError(f"checkpoint {p}: trained on {len(keys)} items, the trace served here has "
                                  f"{len(item_keys)}: train the model on this trace (racer model train) or serve "
                                  f"the trace it was trained on ({m.get('trace', {}).get('path', '?')})")
        if item_keys_digest(item_keys) != item_keys_digest(keys):
            first = next(i for i, (a, b) in enumerate(zip(keys, item_keys)) if a != b)
            raise CheckpointError(f"checkpoint {p}: its item-id mapping differs from the trace served here "
                                  f"(dense id {first} is item {keys[first]!r} in the checkpoint, "
                                  f"{item_keys[first]!r} here)")
    if item_keys_sha256 is not None and (got := item_keys_digest(keys)) != item_keys_sha256:
        raise CheckpointError(f"checkpoint {p}: its item-id mapping (items sha256 {got[:12]}..) differs from the "
                              f"trace served here ({item_keys_sha256[:12]}..): another trace or item order")
    try:
        tensors = torch.load(p / WEIGHTS_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one clear refusal
        raise CheckpointError(f"checkpoint {p}: {WEIGHTS_FILE} does not load ({e})") from None
    if not isinstance(tensors, dict) or "item_embeddings" not in tensors:
        raise CheckpointError(f"checkpoint {p}: {WEIGHTS_FILE} holds no item_embeddings")
    table = tensors.pop("item_embeddings")
    if tuple(table.shape) != (len(keys), cfg.embedding_dim):
        raise CheckpointError(f"checkpoint {p}: item_embeddings is {list(table.shape)}, the config and mapping "
                              f"say [{len(keys)}, {cfg.embedding_dim}]")
    state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    model = HSTUModel(cfg)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {p}: the weights do not fit the config ({e})") from None
    model.eval()
    return Checkpoint(str(p), cfg, model, table.to(torch.float32).contiguous(), keys, m)
