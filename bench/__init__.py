"""Benchmarks that print their figures (``python -m bench.<name> --json``)."""


def load_bench_trace(kind: str, path: str | None):
    """The trace to benchmark on and its name: the sample (or ``path``), else a synthetic trace
    of a similar shape when the sample is not there (a fresh machine without ../shared/data)."""
    from workloads import load_trace, synthetic_trace

    try:
        trace = load_trace(kind, path)
        return trace, trace.source_path
    except FileNotFoundError:
        return synthetic_trace(num_users=1_000, num_items=50_000, mean_seq_len=100), "synthetic (sample trace not found)"
