"""Benchmarks that print their figures (``python -m bench.<name> --json``)."""


class MissingTraceError(FileNotFoundError):
    """The trace a benchmark needs is not there; the message says where it was looked for."""


def load_bench_trace(kind: str, path: str | None):
    """The trace to benchmark on and its name: the sample under ../shared/data (or
    ``$RACER_DATA_DIR``), or ``path``. A missing trace raises `MissingTraceError` naming the
    trace and where to put it: a figure measured on another trace must never pass for this one
    (tests that need the sample skip when it is missing)."""
    from workloads import load_trace

    try:
        trace = load_trace(kind, path)
    except FileNotFoundError as e:
        raise MissingTraceError(f"the {kind} trace is not available ({e}); put the sample under ../shared/data "
                                f"(or set RACER_DATA_DIR) or pass --path") from None
    return trace, trace.source_path


def print_figures(out: dict, *, as_json: bool, width: int) -> None:
    """A benchmark's figures: one JSON object (``--json``), else a line per figure, its name
    padded to ``width``."""
    import json

    if as_json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:<{width}} {v}")
