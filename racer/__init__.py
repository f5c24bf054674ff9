"""RACER: runtime EMB/KV memory splitting for generative-recommender serving."""

__version__ = "0.1.0"
