"""Shared pytest set-up: CUDA-marked tests run only where torch sees a GPU; paths to sample data;
`one_thread` for modules that run the model on the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("RACER_DATA_DIR", REPO.parent / "shared" / "data"))
TAOBAO_SAMPLE = SHARED_DATA / "taobao_userbehavior" / "UserBehavior_userprefix_84k.csv"
AMAZON_SAMPLE = SHARED_DATA / "amazon_video_games" / "Amazon_Video_Games.inter"
# tests that run the benchmarks on the sample traces skip without them (the benchmarks refuse
# to run on a substitute: bench.MissingTraceError)
needs_samples = pytest.mark.skipif(not (TAOBAO_SAMPLE.exists() and AMAZON_SAMPLE.exists()),
                                   reason="../shared/data (the sample traces) not present")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): on
    these shared 2-core VMs a 2-thread OpenMP region stalls for ms."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if any("cuda" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
