"""Trace loaders: Taobao UserBehavior, Amazon (RecBole atomic files), MovieLens, SASRec sequences.

Each loader takes any path (the small samples in ../shared/data or the full downloads) and returns
one `Trace`. Bad input raises `TraceFormatError` naming the file and the 1-based line. The one
exception is a last line that is cut short (the file does not end in a newline and the line does
not parse): it is skipped and counted in ``Trace.num_skipped_lines``, never silently dropped.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from .trace import Trace, build_trace

TAOBAO_BEHAVIORS = ("pv", "cart", "fav", "buy")


class TraceFormatError(ValueError):
    """A trace file that does not parse; the message names the file and the line."""

    def __init__(self, path: str | os.PathLike, line_no: int | None, message: str):
        self.path = str(path)
        self.line_no = line_no
        where = f"{self.path}:{line_no}" if line_no is not None else self.path
        super().__init__(f"{where}: {message}")


class _Truncated(Exception):
    """Raised by a row parser; the caller decides whether the row is a cut-off last line."""


def _lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(1-based line number, text without its newline, whether the line ended with a newline)."""
    with open(path, encoding="utf-8", errors="strict", newline="") as f:
        try:
            for n, raw in enumerate(f, start=1):
                if raw.endswith("\n"):
                    text = raw[:-2] if raw.endswith("\r\n") else raw[:-1]
                    yield n, text, True
                else:
                    yield n, raw, False
        except UnicodeDecodeError as e:
            raise TraceFormatError(path, None, f"not UTF-8 text ({e})") from e


def _check_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"trace file not found: {p}")
    if p.is_dir():
        raise TraceFormatError(p, None, "is a directory, expected a file")
    return p


def _parse_rows(
    path: Path,
    parse: Callable[[int, list[str]], tuple[str, str, float] | None],
    split: Callable[[str], list[str]],
    skip_header: bool,
    max_rows: int | None,
) -> tuple[list[str], list[str], list[float], int]:
    """Run ``parse`` over every data line; return users, items, timestamps and skipped count."""
    users: list[str] = []
    items: list[str] = []
    times: list[float] = []
    skipped = 0
    pending_error: TraceFormatError | None = None
    for n, text, had_newline in _lines(path):
        if pending_error is not None:  # a bad line followed by more lines is a real error
            raise pending_error
        if skip_header and n == 1:
            continue
        if not text.strip():
            continue
        try:
            row = parse(n, split(text))
        except (TraceFormatError, _Truncated) as e:
            err = e if isinstance(e, TraceFormatError) else TraceFormatError(path, n, str(e))
            if had_newline:
                raise err from None
            pending_error = err  # maybe the cut-off last line: decided when the file ends
            continue
        if row is None:
            continue
        users.append(row[0])
        items.append(row[1])
        times.append(row[2])
        if max_rows is not None and len(users) >= max_rows:
            break
    if pending_error is not None:
        skipped += 1  # the file ended inside this line: a truncated last line
    return users, items, times, skipped


def _number(path: Path, n: int, field: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise TraceFormatError(path, n, f"{field} {value!r} is not a number") from None


def load_taobao(path: str | os.PathLike, *, num_shards: int = 64, max_rows: int | None = None) -> Trace:
    """Taobao UserBehavior CSV, no header: ``user_id,item_id,category_id,behavior_type,timestamp``.

    behavior_type is one of pv, cart, fav, buy; timestamp is Unix seconds. Every behaviour counts
    as an interaction (each is an item the model embeds); the mix is kept in ``behavior_counts``.
    """
    p = _check_path(path)
    category_of: dict[str, str] = {}
    behaviors: Counter[str] = Counter()

    def parse(n: int, f: list[str]) -> tuple[str, str, float]:
        if len(f) != 5:
            raise TraceFormatError(p, n, f"expected 5 comma-separated fields "
                                   f"(user_id,item_id,category_id,behavior_type,timestamp), got {len(f)}")
        user, item, cat, behavior, ts = f
        if not user or not item:
            raise TraceFormatError(p, n, "empty user_id or item_id")
        if behavior not in TAOBAO_BEHAVIORS:
            raise TraceFormatError(p, n, f"behavior_type {behavior!r} is not one of {', '.join(TAOBAO_BEHAVIORS)}")
        t = _number(p, n, "timestamp", ts)
        behaviors[behavior] += 1
        category_of.setdefault(item, cat)
        return user, item, t

    users, items, times, skipped = _parse_rows(p, parse, lambda s: s.split(","), False, max_rows)
    return build_trace("taobao", str(p), users, items, times, item_category_of=category_of,
                       num_shards=num_shards, num_skipped_lines=skipped, behavior_counts=dict(behaviors))


def _recbole_header(path: Path, text: str, required: tuple[str, ...]) -> dict[str, int]:
    cols = {}
    for i, col in enumerate(text.split("\t")):
        cols[col.split(":", 1)[0].strip()] = i
    missing = [c for c in required if c not in cols]
    if missing:
        raise TraceFormatError(path, 1, f"header lacks {', '.join(missing)} "
                               f"(a RecBole atomic file's header names columns like 'user_id:token')")
    return cols


def _first_line(path: Path) -> str:
    for _, text, _ in _lines(path):
        return text
    raise TraceFormatError(path, None, "empty file")


def load_amazon_items(path: str | os.PathLike) -> dict[str, str]:
    """RecBole ``.item`` file: item_id -> category, the 2nd element of ``categories`` (the platform).

    ``categories`` is a token sequence such as ``'Video Games', 'PC', 'Games'``; an item whose
    sequence has one element gets that one; an empty sequence gives no category.
    """
    p = _check_path(path)
    cols = _recbole_header(p, _first_line(p), ("item_id", "categories"))
    i_item, i_cat = cols["item_id"], cols["categories"]
    width = max(cols.values()) + 1
    out: dict[str, str] = {}
    for n, text, _ in _lines(p):
        if n == 1 or not text.strip():
            continue
        f = text.split("\t")
        if len(f) < width:
            f += [""] * (width - len(f))  # trailing empty columns may be cut by the writer
        tokens = [t.strip().strip("'\"") for t in f[i_cat].split(",") if t.strip()]
        if tokens:
            out[f[i_item]] = tokens[1] if len(tokens) > 1 else tokens[0]
    return out


def load_amazon(path: str | os.PathLike, *, item_path: str | os.PathLike | None = None,
                num_shards: int = 64, max_rows: int | None = None) -> Trace:
    """RecBole atomic ``.inter`` file (tab-separated, typed header ``user_id:token item_id:token
    rating:float timestamp:float``), optionally with the ``.item`` file for categories.

    Without ``item_path`` a sibling ``<stem>_item.txt`` or ``<stem>.item`` is used when present.
    """
    p = _check_path(path)
    cols = _recbole_header(p, _first_line(p), ("user_id", "item_id", "timestamp"))
    iu, ii, it = cols["user_id"], cols["item_id"], cols["timestamp"]
    width = max(iu, ii, it) + 1

    def parse(n: int, f: list[str]) -> tuple[str, str, float]:
        if len(f) < width:
            raise TraceFormatError(p, n, f"expected at least {width} tab-separated fields, got {len(f)}")
        if not f[iu] or not f[ii]:
            raise TraceFormatError(p, n, "empty user_id or item_id")
        return f[iu], f[ii], _number(p, n, "timestamp", f[it])

    users, items, times, skipped = _parse_rows(p, parse, lambda s: s.split("\t"), True, max_rows)
    if item_path is None:
        for cand in (p.with_name(p.stem + "_item.txt"), p.with_suffix(".item")):
            if cand.exists():
                item_path = cand
                break
    categories = load_amazon_items(item_path) if item_path is not None else None
    return build_trace("amazon", str(p), users, items, times, item_category_of=categories,
                       num_shards=num_shards, num_skipped_lines=skipped)


def load_movielens(path: str | os.PathLike, *, num_shards: int = 64, max_rows: int | None = None) -> Trace:
    """MovieLens ``u.data``: tab-separated ``user item rating timestamp``, no header."""
    p = _check_path(path)

    def parse(n: int, f: list[str]) -> tuple[str, str, float]:
        if len(f) != 4:
            raise TraceFormatError(p, n, f"expected 4 tab-separated fields (user item rating timestamp), got {len(f)}")
        _number(p, n, "rating", f[2])
        return f[0], f[1], _number(p, n, "timestamp", f[3])

    users, items, times, skipped = _parse_rows(p, parse, lambda s: s.split("\t"), False, max_rows)
    return build_trace("movielens", str(p), users, items, times, num_shards=num_shards, num_skipped_lines=skipped)


def load_sequences(path: str | os.PathLike, *, num_shards: int = 64, max_rows: int | None = None) -> Trace:
    """One interaction per line, ``user item [timestamp]``, whitespace-separated, rows grouped by
    user in time order (SASRec's preprocessed format). Without timestamps the line order is time.

    A user whose rows are not contiguous, or whose timestamps go backwards, is an error.
    """
    p = _check_path(path)
    seen: set[str] = set()
    state = {"user": None, "t": float("-inf"), "pos": 0}

    def parse(n: int, f: list[str]) -> tuple[str, str, float]:
        if len(f) not in (2, 3):
            raise TraceFormatError(p, n, f"expected 'user item [timestamp]', got {len(f)} fields")
        user, item = f[0], f[1]
        if user != state["user"]:
            if user in seen:
                raise TraceFormatError(p, n, f"rows of user {user!r} are not contiguous (the format groups rows by user)")
            seen.add(user)
            state["user"], state["t"] = user, float("-inf")
        state["pos"] += 1
        t = _number(p, n, "timestamp", f[2]) if len(f) == 3 else float(state["pos"])
        if t < state["t"]:
            raise TraceFormatError(p, n, f"timestamp {f[2]} goes back in time for user {user!r}")
        state["t"] = t
        return user, item, t

    users, items, times, skipped = _parse_rows(p, parse, str.split, False, max_rows)
    return build_trace("sequences", str(p), users, items, times, num_shards=num_shards, num_skipped_lines=skipped)


SYNTHETIC_KEYS = {"users": ("num_users", int), "items": ("num_items", int), "len": ("mean_seq_len", float),
                  "zipf": ("zipf_a", float), "categories": ("num_categories", int), "seed": ("seed", int)}


def parse_synthetic_spec(spec: str) -> dict:
    """``users=200,items=5000,len=60,zipf=1.1,seed=0`` (any subset; `synthetic_trace`'s defaults
    for the rest) -> `synthetic_trace` keyword arguments; a clear ValueError for anything else."""
    out: dict = {}
    for part in (x.strip() for x in str(spec).split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in SYNTHETIC_KEYS:
            raise ValueError(f"synthetic trace spec {spec!r}: want key=value pairs with keys "
                             f"{', '.join(SYNTHETIC_KEYS)}, got {part!r}")
        name, cast = SYNTHETIC_KEYS[key.strip()]
        try:
            out[name] = cast(value)
        except ValueError:
            raise ValueError(f"synthetic trace spec {spec!r}: {key} wants a {cast.__name__}, got {value!r}") from None
    return out


def load_synthetic(spec: str, *, num_shards: int = 64, max_rows: int | None = None) -> Trace:
    """A trace made in code from a spec string instead of a file (`parse_synthetic_spec`): the
    held-out settings of `bench.regret --holdout` and any setting a user wants to construct."""
    from .trace import synthetic_trace

    return synthetic_trace(num_shards=num_shards, **parse_synthetic_spec(str(spec)))


LOADERS: dict[str, Callable[..., Trace]] = {
    "taobao": load_taobao,
    "amazon": load_amazon,
    "movielens": load_movielens,
    "sequences": load_sequences,
    "synthetic": load_synthetic,
}

# Where the project's machines keep the sample traces (../shared/data beside the checkout).
DEFAULT_FILES = {
    "taobao": "taobao_userbehavior/UserBehavior_userprefix_84k.csv",
    "amazon": "amazon_video_games/Amazon_Video_Games.inter",
}


def data_dir() -> Path | None:
    """``$RACER_DATA_DIR``, else ``../shared/data`` beside the checkout or the working directory."""
    env = os.environ.get("RACER_DATA_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent
    for base in (here, Path.cwd()):
        cand = base.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return None


def default_path(kind: str) -> Path:
    """The sample file for ``kind`` under `data_dir()`; a clear error when there is none."""
    rel = DEFAULT_FILES.get(kind)
    root = data_dir()
    if rel is None or root is None or not (root / rel).exists():
        hint = f" (looked for {root / rel})" if rel and root else ""
        raise FileNotFoundError(f"no default file for trace {kind!r}{hint}: pass --path, or set RACER_DATA_DIR")
    return root / rel


def load_trace(kind: str, path: str | os.PathLike | None = None, **kwargs) -> Trace:
    """Load a trace of ``kind`` (one of `LOADERS`) from ``path`` (default: the sample file)."""
    if kind not in LOADERS:
        raise ValueError(f"unknown trace kind {kind!r}; choose one of {', '.join(LOADERS)}")
    if kind == "synthetic":
        return load_synthetic(path if path is not None else "", **kwargs)
    return LOADERS[kind](path if path is not None else default_path(kind), **kwargs)
