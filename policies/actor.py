"""The actor network, its config and the checkpoint format a training run saves.

Action definition (absolute share, sigmoid-bounded). The actor maps the feature vector
(`node_agent.features`, ``NUM_FEATURES`` floats) to one logit ``z = mlp(features)``; the **mean
action** is the target split ``emb_share = sigmoid(z)`` in (0, 1). For exploration PPO samples
``z' ~ Normal(z, exp(log_std))`` and applies ``sigmoid(z')``; the log-probability is taken of
``z'`` (the sigmoid is a bijection, so its Jacobian cancels in PPO's probability ratio). Only the
mean action is exported to ONNX and run by the node agent.

Why absolute rather than a delta: the paper's allocator *chooses the split*, and its accuracy is
measured against the offline-optimal split; a delta policy compounds its errors and needs the
whole trajectory to say where it is going. Rate limiting is not the actor's job: the runtime's
guards cap the step per decision (and the features carry the current ``emb_share`` and the refill
traffic, so a trained policy can still learn to avoid costly moves).

Checkpoint format (`save_checkpoint` / `load_checkpoint`): one ``torch.save`` file holding a dict
of plain values and tensors, loadable with ``torch.load(weights_only=True)``:

    format="racer-actor-checkpoint", format_version=1,
    actor_config (ActorConfig as a dict), feature_schema_version, feature_names,
    state_dict (the Actor's, log_std included), training_config (JSON-able dict),
    evaluation (JSON-able dict of figures)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from common.config import ranged, require, validate
from node_agent.features import FEATURE_NAMES, NUM_FEATURES, SCHEMA_VERSION

CHECKPOINT_FORMAT = "racer-actor-checkpoint"
CHECKPOINT_VERSION = 1
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


class CheckpointError(ValueError):
    """A checkpoint this code cannot load; the message says why."""


@dataclass(frozen=True)
class ActorConfig:
    """The actor's shape.

    - ``num_features``: input width; must equal the feature schema's ``NUM_FEATURES``;
    - ``hidden_sizes``: widths of the hidden layers (1 to 4 layers, each 1..1024);
    - ``activation``: ``tanh`` or ``relu``;
    - ``init_log_std``: initial log standard deviation of PPO's Gaussian on the logit (training only);
    - ``feature_schema_version``: the schema the actor is trained on.
    """

    num_features: int = NUM_FEATURES
    hidden_sizes: tuple[int, ...] = ranged((64, 64), lo=1, hi=1024, integer=True, length=(1, 4))
    activation: str = ranged("tanh", choices=sorted(ACTIVATIONS))
    init_log_std: float = ranged(-1.0, lo=-10, hi=2)
    feature_schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
        validate(self)
        require(self, self.num_features == NUM_FEATURES,
                f"num_features must be {NUM_FEATURES} (schema {SCHEMA_VERSION}), got {self.num_features}")
        require(self, self.feature_schema_version == SCHEMA_VERSION,
                f"feature_schema_version must be {SCHEMA_VERSION}, got {self.feature_schema_version}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden_sizes"] = list(self.hidden_sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ActorConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ActorConfig keys: {sorted(unknown)}")
        return cls(**{**d, "hidden_sizes": tuple(d.get("hidden_sizes", (64, 64)))})


class Actor(nn.Module):
    """features [batch, NUM_FEATURES] float32 -> mean action emb_share [batch, 1] in (0, 1)."""

    def __init__(self, config: ActorConfig | None = None):
        super().__init__()
        self.config = config or ActorConfig()
        act = ACTIVATIONS[self.config.activation]
        layers: list[nn.Module] = []
        width = self.config.num_features
        for h in self.config.hidden_sizes:
            layers += [nn.Linear(width, h), act()]
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1)
        self.log_std = nn.Parameter(torch.full((1,), float(self.config.init_log_std)))

    def logit(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(features))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """The mean action (what is exported): ``sigmoid(logit)``, shape [batch, 1]."""
        return torch.sigmoid(self.logit(features))

    def logit_distribution(self, features: torch.Tensor) -> torch.distributions.Normal:
        """PPO's sampling distribution over the pre-sigmoid logit."""
        mean = self.logit(features)
        return torch.distributions.Normal(mean, self.log_std.exp().expand_as(mean))


def make_initial_actor(seed: int, config: ActorConfig | None = None, head_gain: float = 0.01) -> Actor:
    """A freshly initialised actor, deterministic for ``seed`` (CleanRL's init: orthogonal weights,
    gain sqrt(2) in hidden layers and ``head_gain`` in the head, zero biases, so the untrained mean
    action is close to sigmoid(0) = 0.5). The global RNG is left untouched, and the weights are
    bit-identical whatever the thread settings."""
    gen = torch.Generator().manual_seed(int(seed))
    with torch.random.fork_rng(devices=[]):  # nn.Linear's default init draws from the global RNG
        actor = Actor(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the orthogonal init's QR rounds differently with more threads
    try:
        with torch.no_grad():
            for m in actor.body:
                if isinstance(m, nn.Linear):
                    nn.init.orthogonal_(m.weight, gain=math.sqrt(2), generator=gen)
                    m.bias.zero_()
            nn.init.orthogonal_(actor.head.weight, gain=head_gain, generator=gen)
            actor.head.bias.zero_()
    finally:
        torch.set_num_threads(threads)
    return actor.eval()


def _json_dict(value: dict | None, what: str) -> dict:
    value = dict(value or {})
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a JSON-able dict of finite values: {e}") from None
    return value


def save_checkpoint(path: str | Path, actor: Actor, *, training_config: dict | None = None,
                    evaluation: dict | None = None) -> Path:
    """Write ``actor`` with its config, the feature schema, the training config and evaluation figures."""
    path = Path(path)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "actor_config": actor.config.to_dict(),
        "feature_schema_version": SCHEMA_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "state_dict": {k: v.detach().cpu().clone() for k, v in actor.state_dict().items()},
        "training_config": _json_dict(training_config, "training_config"),
        "evaluation": _json_dict(evaluation, "evaluation"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return path


@dataclass
class ActorCheckpoint:
    actor: Actor
    config: ActorConfig
    training_config: dict = field(default_factory=dict)
    evaluation: dict = field(default_factory=dict)


def load_checkpoint(path: str | Path) -> ActorCheckpoint:
    """Read a checkpoint written by `save_checkpoint`; raise `CheckpointError` (or
    FileNotFoundError) with the reason when it is not one this code can use."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file (pickle, zip, runtime)
        raise CheckpointError(f"{path}: not a readable torch checkpoint: {type(e).__name__}: {e}") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a {CHECKPOINT_FORMAT} file")
    if payload.get("format_version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: format_version {payload.get('format_version')!r}, "
                              f"expected {CHECKPOINT_VERSION}")
    if payload.get("feature_schema_version") != SCHEMA_VERSION:
        raise CheckpointError(f"{path}: trained on feature schema {payload.get('feature_schema_version')!r}, "
                              f"this code builds schema {SCHEMA_VERSION}")
    if list(payload.get("feature_names", [])) != list(FEATURE_NAMES):
        raise CheckpointError(f"{path}: feature names differ from schema {SCHEMA_VERSION}'s")
    try:
        config = ActorConfig.from_dict(payload["actor_config"])
        actor = Actor(config)
        actor.load_state_dict(payload["state_dict"], strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot rebuild the actor: {e}") from None
    return ActorCheckpoint(actor=actor.eval(), config=config,
                           training_config=dict(payload.get("training_config") or {}),
                           evaluation=dict(payload.get("evaluation") or {}))
