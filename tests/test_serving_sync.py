"""The serving path's synchronisation, on the CPU: stage timers (wall clock on the CPU, events on
the serving stream on CUDA, nothing when off), the CUDA refill and demand-copy code driven
through fake streams and events (who records, who waits for whom), a slow refill chunk in
flight that a demand miss does not wait for, the policy's default provider, and racer up's
device placement."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
import torch

import node_agent.passes as passes_module
from node_agent.device_io import CudaStageTimer, NoStageTimer, StageTimer, make_stage_timer, sync_serving
from node_agent.engine import Engine, EngineConfig, LinkEmulationConfig, RecRequest
from node_agent.memory import Arena, EmbCache, KVLayout, MemoryConfig, RefillConfig
from node_agent.memory.emb_refill import CudaRefillStream, RefillStream
from node_agent.model import ModelConfig

NUM_ITEMS = 500
MODEL = ModelConfig(embedding_dim=16, num_layers=2, num_heads=2, qk_dim=8, v_dim=8, seed=3)
DIM = 4

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ fake CUDA ---


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, ev) -> None:
        self.log.append((self.name, "wait_event", ev.stream.name))

    def synchronize(self) -> None:
        self.log.append((self.name, "synchronize"))


class FakeEvent:
    def __init__(self, log: list, enable_timing: bool = False) -> None:
        self.log, self.enable_timing = log, enable_timing
        self.stream = None
        self.t = None

    def record(self, stream) -> None:
        self.stream, self.t = stream, time.perf_counter()
        self.log.append((stream.name, "record"))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append((self.stream.name, "event_synchronize"))

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.enable_timing and end.enable_timing
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's streams and events as fakes that log who records and who waits; a device-wide
    synchronize fails the test."""
    log: list = []
    serving, refill = FakeStream("serving", log), FakeStream("refill", log)

    @contextlib.contextmanager
    def use(stream):
        log.append((stream.name, "enter"))
        yield
        log.append((stream.name, "exit"))

    def device_wide(*a, **k):
        raise AssertionError("torch.cuda.synchronize waits for every stream of the device")

    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False, **kw: FakeEvent(log, enable_timing))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0, **kw: refill)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: serving)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    return log, serving, refill


# ---------------------------------------------------------------------------- stage timers ---


def test_the_cpu_timer_reads_the_clock_and_off_reads_nothing():
    t = [10.0]

    def clock():
        t[0] += 0.5
        return t[0]

    cpu = StageTimer(clock)
    a, b = cpu.mark(), cpu.mark()
    assert (a, b) == (10.5, 11.0) and cpu.elapsed_us(a, b) == pytest.approx(5e5) and cpu.enabled
    off = NoStageTimer()
    assert off.mark() is None and off.elapsed_us(None, None) == 0.0 and not off.enabled
    assert t[0] == 11.0  # the off timer never read the clock


def test_the_timer_is_chosen_by_device_type_and_switch(fake_cuda):
    log, serving, _ = fake_cuda
    clock = time.perf_counter
    assert type(make_stage_timer(torch.device("cpu"), clock)) is StageTimer
    assert isinstance(make_stage_timer(torch.device("cpu"), clock, enabled=False), NoStageTimer)
    assert isinstance(make_stage_timer(torch.device("cuda:1"), clock, enabled=False), NoStageTimer)
    given = FakeStream("given", log)
    assert make_stage_timer(torch.device("cuda:1"), clock, stream=given).stream is given
    cur = make_stage_timer(torch.device("cuda"), clock)
    assert isinstance(cur, CudaStageTimer) and cur.stream is serving  # the thread's current stream
    assert log == []  # choosing records nothing


def test_the_cuda_timer_records_on_the_serving_stream_and_waits_only_for_its_end_event(fake_cuda):
    log, serving, _ = fake_cuda
    timer = CudaStageTimer(serving)
    a = timer.mark()
    time.sleep(0.002)
    b = timer.mark()
    assert a.enable_timing and b.enable_timing
    us = timer.elapsed_us(a, b)
    assert 2000 <= us < 1e6
    assert log == [("serving", "record"), ("serving", "record"), ("serving", "event_synchronize")]


# ------------------------------------------------------------------------------------ engine ---


def make_engine(**kw) -> Engine:
    cfg = EngineConfig(model=MODEL, num_items=NUM_ITEMS, num_pages=kw.pop("num_pages", 256), page_tokens=4,
                       emb_share=kw.pop("emb_share", 0.5), max_history_len=256, max_candidates=64,
                       default_num_candidates=16, default_top_k=5, link=LinkEmulationConfig(mode="off"),
                       refill=kw.pop("refill", RefillConfig(limit_bytes_per_s=1e6, window_s=0.1, chunk_bytes=1024)),
                       **kw)
    return Engine(cfg, item_popularity=np.arange(NUM_ITEMS)[::-1].astype(np.float64))


def requests(n: int, seed: int, hist: int = 12) -> list[RecRequest]:
    rng = np.random.default_rng(seed)
    return [RecRequest(int(u), rng.integers(0, NUM_ITEMS, hist), rng.integers(0, NUM_ITEMS, 4),
                       candidates=rng.choice(NUM_ITEMS, 20, replace=False)) for u in range(n)]


def test_the_engine_times_stages_with_serving_stream_events_and_never_syncs_the_device(fake_cuda, monkeypatch):
    """The engine's CUDA timing path run on the CPU: every mark is an event on the serving
    stream, every read waits for one event, and the answers match the wall-clock path's."""
    log, serving, _ = fake_cuda
    monkeypatch.setattr(passes_module, "make_stage_timer",
                        lambda device, clock, enabled=True, stream=None: CudaStageTimer(serving))
    eng, ref = make_engine(), make_engine()
    for reqs in (requests(3, 1), requests(3, 1)):  # misses, then KV hits
        got, want = eng.serve_batch(reqs), ref.serve_batch(reqs)
        for g, w in zip(got, want):
            assert g.items == w.items and g.scores == pytest.approx(w.scores)
            lat = g.latency
            assert min(lat.emb_lookup_us, lat.kv_read_us, lat.prefill_us, lat.kv_write_us, lat.rank_us) > 0
            assert lat.compute_us == pytest.approx(lat.prefill_us + lat.rank_us)
            assert lat.total_us >= lat.emb_lookup_us + lat.compute_us
    assert log and {e[0] for e in log} == {"serving"}  # nothing on or for another stream
    assert {e[1] for e in log} == {"record", "event_synchronize"}
    sync_serving(torch.device("cuda"))  # the host wait's CUDA branch, on the fakes: the serving stream only
    assert log[-1] == ("serving", "synchronize")


def test_stage_timing_off_records_nothing_and_keeps_queue_and_total(monkeypatch):
    made = []
    real = passes_module.make_stage_timer
    monkeypatch.setattr(passes_module, "make_stage_timer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    eng = make_engine(stage_timing=False)
    t0 = eng.clock()
    r = eng.serve(RecRequest(1, [3, 4, 5], [6], candidates=[7, 8, 9], arrival_s=t0 - 0.01))
    assert made and all(isinstance(t, NoStageTimer) for t in made)
    lat = r.latency
    assert (lat.emb_lookup_us, lat.batch_wait_us, lat.kv_read_us, lat.prefill_us, lat.kv_write_us, lat.rank_us,
            lat.compute_us) == (0.0,) * 7
    assert lat.queue_us >= 1e4 and lat.total_us > lat.queue_us
    assert r.items and r.kv.outcome == "miss"
    with pytest.raises(ValueError, match="stage_timing"):
        EngineConfig(model=MODEL, num_items=NUM_ITEMS, stage_timing="yes")


# ---------------------------------------------------------------------- CUDA copies on CPU ---


def host_table(n: int) -> torch.Tensor:
    return torch.arange(n * DIM, dtype=torch.float32).view(n, DIM) / DIM


def make_cache(num_pages: int = 8, num_items: int = 64, emb_share: float = 0.5) -> EmbCache:
    kv = KVLayout(num_layers=1, num_heads=1, head_dim=1, page_tokens=2)  # a page holds one row
    cfg = MemoryConfig(num_pages=num_pages, num_items=num_items, emb_dim=DIM, kv=kv,
                       initial_emb_share=emb_share, device="cpu")
    return EmbCache(Arena(cfg), num_items, host_table(num_items))


def test_the_cuda_refill_waits_for_the_serving_stream_and_never_the_reverse(fake_cuda):
    log, serving, refill = fake_cuda
    rs = CudaRefillStream(torch.device("cpu"))  # the CUDA code; pinning is for CUDA only
    assert rs.stream is refill
    table = host_table(16)
    slab = torch.zeros(6, DIM)
    done = rs.copy(slab, torch.tensor([4, 1]), table, torch.tensor([9, 3]))
    assert torch.equal(slab[4], table[9]) and torch.equal(slab[1], table[3])
    assert log == [("serving", "record"), ("refill", "wait_event", "serving"), ("refill", "enter"),
                   ("refill", "record"), ("refill", "exit")]
    assert done.stream is refill
    buf = rs.staging
    rs.copy(slab, torch.tensor([0]), table, torch.tensor([5]))
    assert rs.staging is buf and torch.equal(slab[0], table[5])  # reused
    rs.copy(slab, torch.tensor([0, 2, 3]), table, torch.tensor([1, 2, 3]))
    assert rs.staging.shape[0] == 3 and not rs.staging.is_pinned()  # grown
    assert not any(e[0] == "serving" and e[1] in ("wait_event", "synchronize") for e in log)


def test_demand_misses_go_through_a_reused_staging_buffer_on_the_serving_stream(fake_cuda):
    log, serving, _ = fake_cuda
    c = make_cache()
    rows = c.demand.staged_rows(torch.tensor([5, 7, 9]))
    assert torch.equal(rows, host_table(64)[[5, 7, 9]])
    buf = c.demand.staging
    assert log == [("serving", "record")]  # the copy's event, on the serving stream
    rows = c.demand.staged_rows(torch.tensor([2]))
    assert torch.equal(rows, host_table(64)[[2]]) and c.demand.staging is buf
    # before the buffer is rewritten: the previous copy's event, nothing else
    assert log[1:] == [("serving", "event_synchronize"), ("serving", "record")]
    c.demand.staged_rows(torch.arange(10))
    assert c.demand.staging.shape[0] >= 10
    assert {e[0] for e in log} == {"serving"}


def test_a_chunk_is_issued_from_the_host_candidate_list():
    c = make_cache(emb_share=0.25)  # 2 rows of 8
    got = []

    class Recorder(RefillStream):
        def copy(self, slab_rows, slots, table, items_host):
            got.append(items_host.clone())
            return super().copy(slab_rows, slots, table, items_host)

    c.refill.stream = Recorder()
    c.lookup(torch.tensor([1, 2, 3, 3, 4, 4, 4]))  # 1, 2 cached; 3, 4 bypassed
    c.arena.set_emb_pages(8)
    c.grow(8)
    assert c.refill.issue(8) == 2
    assert [t.tolist() for t in got] == [[4, 3]]
    assert c.check_invariants() == []


# -------------------------------------------------------------- a slow refill chunk in flight ---


class SlowRefill(RefillStream):
    """A chunk copied by a thread (a copy engine) that lands once the test releases it, or after
    ``max_delay_s`` (a demand path that waited for it would wait that long, then be seen in the
    timeline after the chunk); its handle logs any wait for it."""

    def __init__(self, timeline: list, max_delay_s: float = 5.0) -> None:
        self.timeline, self.max_delay_s = timeline, max_delay_s
        self.release = threading.Event()

    def copy(self, slab_rows, slots, table, items_host):
        rows = table.index_select(0, items_host)
        done = threading.Event()
        tl = self.timeline

        def land():
            self.release.wait(self.max_delay_s)
            slab_rows.index_copy_(0, slots, rows)
            tl.append(("refill done", time.perf_counter()))
            done.set()

        class Handle:
            def query(self):
                return done.is_set()

            def synchronize(self):
                tl.append(("refill waited for", time.perf_counter()))
                done.wait()

        tl.append(("refill issued", time.perf_counter()))
        threading.Thread(target=land, daemon=True).start()
        return Handle()


def first(timeline: list, name: str) -> float:
    return min(t for n, t in timeline if n == name)


def test_a_demand_miss_does_not_wait_for_a_refill_chunk_in_flight():
    c = make_cache(num_pages=16, emb_share=0.25)  # 4 rows of 16
    c.lookup(torch.tensor([1, 2, 3, 4] + [10, 11, 12] * 3))  # 10-12 bypassed, 3 misses each
    c.arena.set_emb_pages(16)
    c.grow(16)
    tl: list = []
    c.refill.stream = slow = SlowRefill(tl)
    assert c.refill.issue(8) == 3 and c.refill.inflight
    r = c.lookup(torch.tensor([40, 41, 1]))  # two demand misses while the chunk is in flight
    tl.append(("demand done", time.perf_counter()))
    assert torch.equal(r.rows, host_table(64)[[40, 41, 1]]) and r.num_unique_misses == 2
    assert c.refill.inflight and not c.refill.poll()  # the chunk is still in flight
    slow.release.set()
    c.refill.wait()
    assert first(tl, "refill issued") < first(tl, "demand done") < first(tl, "refill done")
    assert first(tl, "demand done") < first(tl, "refill waited for")  # only the explicit wait waited
    assert c.check_invariants() == []
    assert set(c.resident_items().tolist()) >= {10, 11, 12, 40, 41}


def test_an_engine_answers_while_a_refill_chunk_is_in_flight():
    eng = make_engine(num_pages=64, emb_share=0.25,
                      refill=RefillConfig(limit_bytes_per_s=1e7, window_s=0.1, chunk_bytes=4096))
    for req in requests(6, 2, hist=40):  # many misses: popularity for the refill
        eng.serve(req)
    emb = eng.mm.emb
    tl: list = []
    emb.refill.stream = slow = SlowRefill(tl)
    now = 10.0
    eng.set_emb_share(0.75, now)
    for _ in range(200):
        now += 0.05
        eng.maintenance(now)
        if emb.refill.inflight:
            break
    assert emb.refill.inflight
    r = eng.serve(RecRequest(99, [450, 451, 452], [453], candidates=[460, 461, 462, 463]))
    tl.append(("demand done", time.perf_counter()))
    assert r.emb_hits < r.emb_rows  # it had misses to copy
    assert emb.refill.inflight  # answered with the chunk still in flight
    slow.release.set()
    emb.refill.wait()
    assert first(tl, "refill issued") < first(tl, "demand done") < first(tl, "refill done")
    assert first(tl, "demand done") < first(tl, "refill waited for")
    assert eng.check_invariants() == []


# ------------------------------------------------------------------------------- the policy ---


def test_the_policy_session_defaults_to_the_cpu_provider(tmp_path):
    from node_agent.allocator.base import OnnxPolicy, session_providers
    from node_agent.artifact import ArtifactError
    from policies.export import export_actor
    from policies.actor import make_initial_actor

    from node_agent.allocator.config import AllocatorConfig

    export_actor(make_initial_actor(11, head_gain=1.0), tmp_path / "p")
    assert OnnxPolicy(tmp_path / "p").providers == ["CPUExecutionProvider"]
    assert AllocatorConfig().device == "cpu"  # what the agent's allocator passes unless told otherwise
    both = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert session_providers("cpu", both, True) == ["CPUExecutionProvider"]
    assert session_providers("cuda", both, True) == both
    assert session_providers("auto", both, True) == both
    assert session_providers("auto", both, False) == ["CPUExecutionProvider"]
    with pytest.raises(ArtifactError, match="wants CUDA"):
        session_providers("cuda", ["CPUExecutionProvider"], True)
    with pytest.raises(ArtifactError, match="policy device"):
        session_providers("gpu", both, True)


# ------------------------------------------------------------------------------- racer up ---


def test_racer_up_places_agents_round_robin_over_devices(tmp_path, monkeypatch):
    import argparse

    import racer.up as up

    assert up.parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    assert up.parse_devices("cpu") == ["cpu"]
    for bad in ("", "gpu0", "cuda:x", "cpu:1", "cuda:-1"):
        with pytest.raises(ValueError):
            up.parse_devices(bad)
    assert [up.node_device(k, ["cuda:0", "cuda:1"]) for k in range(5)] == ["cuda:0", "cuda:1"] * 2 + ["cuda:0"]
    assert up.node_device(3, None) is None and up.node_device(0, []) is None

    ports = iter(range(43000, 43100))
    monkeypatch.setattr(up, "free_port", lambda host="127.0.0.1": next(ports))

    def agents(**kw):
        args = argparse.Namespace(**{**dict(nodes=3, trace="taobao", path=None, policy=None, model="none",
                                            slo_ms=50.0, control_plane_port=0, gateway_port=0, dashboard_port=0),
                                     **kw})
        plan = up.plan_processes(args, tmp_path, {"node-agent"}, "op", {}, None, "sqlite:///x.db")
        return [s.argv for s in plan.specs if s.name.startswith("node-")]

    placed = agents(devices=["cuda:0", "cuda:1"])
    assert [a[a.index("--device") + 1] for a in placed] == ["cuda:0", "cuda:1", "cuda:0"]
    assert all("--device" not in a for a in agents())  # default: each agent's own choice
    parser = argparse.ArgumentParser()
    up.add_up_parser(parser.add_subparsers())
    assert parser.parse_args(["up", "--devices", "cuda:0,cuda:1"]).devices == ["cuda:0", "cuda:1"]
    assert parser.parse_args(["up"]).devices is None
