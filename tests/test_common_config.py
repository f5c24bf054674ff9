"""common.config: ranges declared on config fields, checked by `validate`, read by argparse."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np
import pytest

from common.config import (add_config_arguments, config_kwargs, default_of, help_of, problems, range_of, ranged,
                           require, validate)


@dataclass(frozen=True)
class Inner:
    x: int = ranged(1, lo=0, integer=True)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class Toy:
    share: float = ranged(0.5, lo=0, hi=1, doc="a fraction")
    rate: float = ranged(2.0, lo=0, lo_open=True, doc="requests per second")
    window: int = ranged(9, lo=4, hi=64, integer=True, doc="readings kept")
    count: int = ranged(3, lo=1, integer=True, doc="how many")
    mode: str = ranged("auto", choices=("auto", "on", "off"), doc="when")
    enabled: bool = ranged(True, kind=bool, doc="on or off")
    timeout_s: float | None = ranged(None, lo=0, lo_open=True, optional=True, doc="none: no limit")
    big: float = ranged(1.0, lo=0, finite=False)
    sizes: tuple[int, ...] = ranged((64, 64), lo=1, hi=1024, integer=True, length=(1, 4))
    inner: Inner = ranged(factory=Inner, kind=Inner)
    free: str = "not checked"

    def __post_init__(self) -> None:
        validate(self)
        require(self, self.count <= self.window, f"need count <= window, got {self.count} > {self.window}")


def test_defaults_and_good_values_pass():
    assert Toy().share == 0.5 and Toy().inner == Inner()
    Toy(share=0, rate=1e-9, window=4, count=1, mode="off", enabled=False, timeout_s=3, big=math.inf, sizes=[1],
        inner=Inner(0), free="anything")
    Toy(share=1, window=64, sizes=(1, 2, 3, 1024), rate=np.float64(2.5), count=np.int64(2))
    assert problems(Toy()) == []


@pytest.mark.parametrize("field, value, words", [
    ("share", -0.1, r"share must be in \[0, 1\], got -0.1"),  # below
    ("share", 1.5, r"share must be in \[0, 1\], got 1.5"),  # above
    ("share", math.nan, r"share must be in \[0, 1\], got nan"),
    ("rate", 0, r"rate must be a positive number, got 0"),  # open bound
    ("rate", math.inf, r"rate must be a positive number, got inf"),
    ("rate", "2", r"rate must be a positive number, got '2'"),  # wrong type
    ("rate", True, r"rate must be a positive number, got True"),
    ("window", 3, r"window must be an integer in \[4, 64\], got 3"),
    ("window", 65, r"window must be an integer in \[4, 64\], got 65"),
    ("window", 9.0, r"window must be an integer in \[4, 64\], got 9.0"),
    ("window", True, r"window must be an integer in \[4, 64\], got True"),  # bool for int
    ("count", 0, r"count must be a positive integer, got 0"),
    ("mode", "maybe", r"mode must be one of auto, on, off, got 'maybe'"),  # not in choices
    ("enabled", 1, r"enabled must be a bool, got 1"),
    ("timeout_s", -1, r"timeout_s must be a positive number or None, got -1"),
    ("big", math.nan, r"big must be a number >= 0, got nan"),  # NaN even where inf is fine
    ("big", -math.inf, r"big must be a number >= 0, got -inf"),
    ("sizes", (), r"sizes must be 1 to 4 items, each an integer in \[1, 1024\], got \(\)"),
    ("sizes", (1, 2, 3, 4, 5), r"sizes must be 1 to 4 items"),
    ("sizes", (0,), r"sizes must be 1 to 4 items"),
    ("sizes", "ab", r"sizes must be 1 to 4 items"),
    ("inner", {"x": 1}, r"inner must be a Inner, got \{'x': 1\}"),
])
def test_each_kind_of_bad_value_names_the_class_field_value_and_range(field, value, words):
    with pytest.raises(ValueError, match=r"^invalid Toy: " + words):
        Toy(**{field: value})


def test_every_bad_field_is_listed_once():
    with pytest.raises(ValueError) as e:
        Toy(share=2.0, window=1, mode="x")
    msg = str(e.value)
    assert msg.count(";") == 2 and all(f in msg for f in ("share must", "window must", "mode must"))


def test_cross_field_check_runs_after_the_ranges():
    with pytest.raises(ValueError, match=r"^invalid Toy: need count <= window, got 10 > 9$"):
        Toy(count=10)


def test_range_of_and_unchecked_fields():
    assert range_of(Toy, "window").integer and range_of(Toy(), "share").hi == 1
    with pytest.raises(KeyError, match="Toy.free has no declared range"):
        range_of(Toy, "free")


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy", exit_on_error=False)
    add_config_arguments(p, Toy, ["share", "rate", "window", "mode", "enabled", "timeout_s"], **kw)
    return p


def test_cli_defaults_equal_the_dataclass_defaults():
    args = _parser().parse_args([])
    kw = config_kwargs(args, ["share", "rate", "window", "mode", "enabled", "timeout_s"])
    assert kw == {"share": 0.5, "rate": 2.0, "window": 9, "mode": "auto", "enabled": True, "timeout_s": None}
    assert Toy(**kw) == Toy()
    assert default_of(Toy, "inner") == Inner() and default_of(Toy, "window") == 9


def test_cli_values_flags_prefix_and_help():
    p = _parser(prefix="toy-", flags={"mode": "--toy-when"})
    args = p.parse_args(["--toy-share", "0.25", "--toy-window", "5", "--toy-when", "on", "--no-toy-enabled"])
    assert config_kwargs(args, ["share", "window", "mode", "enabled"], prefix="toy-") == {
        "share": 0.25, "window": 5, "mode": "on", "enabled": False}
    assert help_of(Toy, "window") == "readings kept (default 9; an integer in [4, 64])"
    assert help_of(Toy, "mode") == "when (default auto)"
    assert help_of(Toy, "rate", "req/s") == "req/s (default 2; a positive number)"


@pytest.mark.parametrize("argv, words", [
    (["--share", "1.5"], r"must be in \[0, 1\], got 1.5"),
    (["--window", "4.5"], r"must be an integer, got '4.5'"),
    (["--window", "65"], r"must be an integer in \[4, 64\], got 65"),
    (["--rate", "nan"], r"must be a positive number, got nan"),
])
def test_cli_refuses_out_of_range_with_the_same_words(argv, words):
    with pytest.raises(argparse.ArgumentError, match=words):
        _parser().parse_args(argv)


def test_sequence_fields_have_no_generic_option():
    with pytest.raises(TypeError, match="sequence field"):
        add_config_arguments(argparse.ArgumentParser(), Toy, ["sizes"])
