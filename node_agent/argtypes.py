"""argparse ``type=`` converters shared by every command line (node agent, gateway, dashboard,
policies): one wording for every range error, e.g. ``--port: must be in [0, 65535], got 70000``.

Each raises `argparse.ArgumentTypeError`, which argparse prints with the option's name and exit
status 2.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["non_negative_int", "port", "positive_float", "positive_int", "unit_interval"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def positive_int(text: str) -> int:
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def non_negative_int(text: str) -> int:
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def positive_float(text: str) -> float:
    v = _float(text)
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def unit_interval(text: str) -> float:
    v = _float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return v


def port(text: str) -> int:
    v = _int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {text}")
    return v
