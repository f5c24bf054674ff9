"""Policies for the SmartAllocator: the feature contract, the actor, and its ONNX export.

- `node_agent.features`: `WindowStats` (one control interval on one node), `FEATURE_NAMES`,
  `SCHEMA_VERSION`, `build_features` -- the one state-vector builder shared by training, the
  simulator and the node agent;
- `policies.actor`: the actor network, its config and checkpoint format;
- `policies.export`: ONNX export with checker + parity, the artifact manifest, `verify_artifact`;
- `policies.cli`: the ``racer policy`` subcommands.

Only `node_agent.features` is imported here: it needs numpy alone, so the node agent's hot path and
the simulator never pay for importing torch or onnx through this package.
"""

from node_agent.features import FEATURE_NAMES, NUM_FEATURES, SCHEMA_VERSION, FeatureError, WindowStats, build_features

__all__ = ["FEATURE_NAMES", "NUM_FEATURES", "SCHEMA_VERSION", "FeatureError", "WindowStats", "build_features"]
