"""Config dataclasses whose ranges are declared on the fields, checked by one function and read
by the command line.

    @dataclass(frozen=True)
    class GuardConfig:
        min_emb_share: float = ranged(0.05, lo=0, hi=1, doc="lower bound of the split")
        max_emb_share: float = ranged(0.95, lo=0, hi=1, doc="upper bound of the split")

        def __post_init__(self) -> None:
            validate(self)  # every field's own range
            require(self, self.min_emb_share < self.max_emb_share, "need min_emb_share < max_emb_share")

`validate` lists every field that is out of its range in one `ValueError`, e.g.
``invalid GuardConfig: min_emb_share must be in [0, 1], got 1.5``. Numbers are refused when they
are bools, NaN or (unless ``finite=False``) infinite. Checks across fields stay explicit lines
after it (`require`).

On the command line, `add_config_arguments` adds one option per field, its default, help text,
choices and range read from the field (a value out of range is refused by argparse, with the same
words), and `config_kwargs` reads the parsed values back by field name::

    add_config_arguments(parser, AgentConfig, ["max_batch", "slo_ms"])  # --max-batch, --slo-ms
    AgentConfig(**config_kwargs(args, ["max_batch", "slo_ms"]))
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Range", "add_config_arguments", "config_kwargs", "default_of", "finite_number", "help_of", "problems",
           "ranged", "require", "range_of", "validate"]

_KEY = "racer.range"


def finite_number(v) -> bool:
    """True for a finite int or float (numpy's too), False for a bool, NaN, infinity or anything else."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _show(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclasses.dataclass(frozen=True)
class Range:
    """What one field accepts (see `ranged`)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    finite: bool = True
    choices: tuple | None = None
    kind: type | None = None
    optional: bool = False
    length: tuple[int, int | None] | None = None
    doc: str = ""

    def accepts_item(self, v) -> bool:
        if self.choices is not None:
            return any(v == c and type(v) is type(c) for c in self.choices)
        if self.kind is not None:
            return isinstance(v, self.kind)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral if self.integer else numbers.Real):
            return False
        if math.isnan(v) or (self.finite and not math.isfinite(v)):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def accepts(self, v) -> bool:
        if v is None:
            return self.optional
        if self.length is None:
            return self.accepts_item(v)
        if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
            return False
        least, most = self.length
        return least <= len(v) and (most is None or len(v) <= most) and all(map(self.accepts_item, v))

    def item_words(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        if self.kind is not None:
            return f"a {self.kind.__name__}"
        what = "an integer" if self.integer else "a number"
        if self.lo is not None and self.hi is not None:
            span = f"in {'(' if self.lo_open else '['}{_show(self.lo)}, {_show(self.hi)}{')' if self.hi_open else ']'}"
            return f"an integer {span}" if self.integer else span
        if self.hi is None and ((self.lo == 0 and self.lo_open) or (self.integer and self.lo == 1 and not self.lo_open)):
            return "a positive integer" if self.integer else "a positive number"
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {_show(self.lo)}"
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {_show(self.hi)}"
        return "a finite number" if self.finite and not self.integer else what

    def words(self) -> str:
        """The accepted values in words: ``in (0, 1]``, ``a positive integer``, ``one of a, b``, ..."""
        w = self.item_words()
        if self.length is not None:
            least, most = self.length
            count = (f"{least} to {most} items" if most is not None else "a non-empty sequence" if least == 1
                     else f"at least {least} items" if least else "a sequence")
            w = f"{count}, each {w}"
        return w + (" or None" if self.optional else "")

    def problem(self, name: str, v) -> str | None:
        """None when ``v`` is accepted, else ``"<name> must be <words>, got <v>"``."""
        return None if self.accepts(v) else f"{name} must be {self.words()}, got {v!r}"


def ranged(default: Any = dataclasses.MISSING, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False, integer: bool = False, finite: bool = True,
           choices: Iterable | None = None, kind: type | None = None, optional: bool = False,
           length: tuple[int, int | None] | None = None, factory: Any = dataclasses.MISSING, doc: str = "") -> Any:
    """A dataclass field whose accepted values are declared on it (`validate` checks them).

    - numbers (the default): within ``lo`` / ``hi`` (inclusive unless ``lo_open`` / ``hi_open``),
      whole numbers with ``integer``; never a bool or NaN, and never infinite unless ``finite=False``;
    - ``choices``: one of these values (and of their type) instead of a number;
    - ``kind``: an instance of this type instead (``bool``, ``str``, a nested config class);
    - ``optional``: None is accepted too;
    - ``length=(least, most)``: a sequence of ``least`` to ``most`` (None: any number) items, each
      accepted by the rules above;
    - ``factory``: the default's factory (a nested config), instead of ``default``;
    - ``doc``: one line for the command line's help.
    """
    rule = Range(lo, hi, lo_open, hi_open, integer, finite, None if choices is None else tuple(choices), kind,
                 optional, length, doc)
    return dataclasses.field(default=default, default_factory=factory, metadata={_KEY: rule})


def range_of(cls, name: str) -> Range:
    """The `Range` declared on field ``name`` of config class (or instance) ``cls``."""
    try:
        return cls.__dataclass_fields__[name].metadata[_KEY]
    except KeyError:
        raise KeyError(f"{getattr(cls, '__name__', type(cls).__name__)}.{name} has no declared range") from None


def problems(cfg) -> list[str]:
    """One line per field of ``cfg`` whose value is outside its declared range (empty: all fine)."""
    out = []
    for f in dataclasses.fields(cfg):
        rule = f.metadata.get(_KEY)
        if rule is not None:
            p = rule.problem(f.name, getattr(cfg, f.name))
            if p:
                out.append(p)
    return out


def validate(cfg, what: str | None = None) -> None:
    """Raise ``ValueError("invalid <what>: <problem>; <problem>")`` when a field is out of range
    (``what``: the class name unless given, e.g. ``"profile a100-hstu"``)."""
    p = problems(cfg)
    if p:
        raise ValueError(f"invalid {what or type(cfg).__name__}: " + "; ".join(p))


def require(cfg, ok: bool, problem: str, what: str | None = None) -> None:
    """A check across fields, after `validate`: raise ``invalid <what>: <problem>`` unless ``ok``."""
    if not ok:
        raise ValueError(f"invalid {what or type(cfg).__name__}: {problem}")


# ------------------------------------------------------------------------------- command line ---


def default_of(cls, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (a factory's is built)."""
    f = cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


def help_of(cls, name: str, doc: str | None = None) -> str:
    """Help text of the option for field ``name``: its doc (or ``doc``), default and range."""
    rule = cls.__dataclass_fields__[name].metadata.get(_KEY)
    text = doc if doc is not None else (rule.doc if rule is not None else "")
    default = default_of(cls, name)
    extra = [] if default is None else [f"default {_show(default)}"]  # a None default: the doc says what it means
    if rule is not None and rule.choices is None and rule.kind is None:
        extra.append(rule.words().removesuffix(" or None"))
    return f"{text} ({'; '.join(extra)})" if text else "; ".join(extra)


def _parser_of(rule: Range):
    """argparse ``type=``: parse the text and refuse a value out of ``rule`` with its words."""
    def parse(text: str):
        try:
            v = int(text) if rule.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if rule.integer else 'a number'}, "
                                             f"got {text!r}") from None
        if not rule.accepts_item(v):
            raise argparse.ArgumentTypeError(f"must be {rule.words()}, got {text}")
        return v

    parse.__name__ = "integer" if rule.integer else "number"  # argparse names it in "invalid ... value"
    return parse


def _dest(prefix: str, name: str) -> str:
    return (prefix + name).replace("-", "_")


def add_config_arguments(parser, cls, fields: Iterable[str], *, prefix: str = "",
                         flags: dict[str, str] | None = None, helps: dict[str, str] | None = None) -> None:
    """Add ``--<prefix><field>`` (underscores as dashes) for each of ``fields`` of config ``cls`` to
    ``parser`` (or an argument group): the default, help, choices and range come from the field.

    ``flags`` renames an option (``{"mode": "--link-emulation"}``); ``helps`` replaces a field's doc.
    The parsed value lands in ``args.<prefix><field>`` (dashes as underscores) whatever the flag, so
    `config_kwargs` finds it. A bool field gets ``--x`` / ``--no-x``.
    """
    for name in fields:
        rule = range_of(cls, name)
        flag = (flags or {}).get(name) or "--" + (prefix + name).replace("_", "-")
        kw: dict[str, Any] = {"dest": _dest(prefix, name), "default": default_of(cls, name),
                              "help": help_of(cls, name, (helps or {}).get(name)),
                              "metavar": flag.lstrip("-").upper().replace("-", "_")}
        if rule.length is not None:
            raise TypeError(f"{cls.__name__}.{name}: a sequence field has no generic option; parse it yourself")
        if rule.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
            del kw["metavar"]
        elif rule.choices is not None:
            kw["choices"] = rule.choices
            del kw["metavar"]
        elif rule.kind is None:
            kw["type"] = _parser_of(rule)
        parser.add_argument(flag, **kw)


def config_kwargs(args: argparse.Namespace, fields: Iterable[str], *, prefix: str = "") -> dict[str, Any]:
    """``{field: value}`` read from parsed ``args`` for the ``fields`` that `add_config_arguments`
    added (with the same ``prefix``)."""
    return {n: getattr(args, _dest(prefix, n)) for n in fields}
