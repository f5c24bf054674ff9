"""The GR model: an HSTU-style transformer with per-user K/V reuse and candidate ranking."""

from .hstu import HSTULayer, HSTUModel, KVState, ModelConfig, log_bucket

__all__ = ["HSTULayer", "HSTUModel", "KVState", "ModelConfig", "log_bucket"]
