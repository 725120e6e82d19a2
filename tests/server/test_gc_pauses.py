"""The garbage collector as the server sees it: its pauses measured into /metrics, what
start-up built frozen out of collection, and the server doing that before it serves."""

from __future__ import annotations

import gc
import threading
import types

import pytest

from tests.server.helpers import metric
from verispec.server import gcpause
from verispec.server.gcpause import GCPauses, freeze_startup_heap
from verispec.server.metrics import Metrics


@pytest.fixture
def recorder():
    r = GCPauses()
    gc.callbacks.append(r.callback)
    yield r
    gc.callbacks.remove(r.callback)


def test_each_collection_is_recorded_by_generation(recorder):
    gc.collect(0)
    gc.collect(2)
    gc.collect(2)
    snap = recorder.snapshot()
    assert snap["count"][2] >= 2 and snap["count"][0] >= 1
    assert snap["buckets"][2][-1] <= snap["count"][2]  # cumulative, within the total
    assert 0 < snap["max"] and snap["sum"][2] >= snap["max"] / 2 > 0
    again = recorder.snapshot()
    assert again["count"][2] == snap["count"][2]  # a read drains what was pending, once


def test_collections_in_many_threads_are_all_counted(recorder):
    stops = []

    def count(phase, info):
        if phase == "stop" and info["generation"] == 2:
            stops.append(1)

    before = recorder.snapshot()["count"][2]
    gc.callbacks.append(count)
    try:
        def work():
            for _ in range(20):
                gc.collect(2)  # returns at once if another thread's collection is running
                recorder.snapshot()  # readers fold while other threads collect

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.callbacks.remove(count)
    assert len(stops) >= 20
    assert recorder.snapshot()["count"][2] - before == len(stops)


def test_metrics_show_the_pauses():
    m = Metrics("tiny", {"drafter": "suffix", "k": "4", "rule": "rejection", "lossy": "false"})
    gc.collect()
    text = m.render()
    assert metric(text, "verispec_gc_pause_seconds_count", generation="2") >= 1
    assert metric(text, "verispec_gc_pause_seconds_bucket", generation="2", le="+Inf") == \
        metric(text, "verispec_gc_pause_seconds_count", generation="2")
    assert metric(text, "verispec_gc_pause_max_seconds") > 0
    assert m.gc is gcpause.gc_pauses()  # one recorder for the process


def test_freeze_takes_live_objects_out_of_collection():
    keep = [[i] for i in range(10_000)]  # tracked objects alive across the freeze
    gc.collect()
    try:
        frozen = freeze_startup_heap()
        assert gcpause.gc_pauses().snapshot()["count"] == {0: 0, 1: 0, 2: 0}  # loading's pauses dropped
        assert frozen >= len(keep)
        assert not any(o is keep for o in gc.get_objects())  # collections no longer walk them
        later = [[i] for i in range(10)]
        assert any(o is later for o in gc.get_objects())  # objects made later still are
    finally:
        gc.unfreeze()


def test_serve_freezes_after_loading_and_before_serving(monkeypatch):
    from verispec.cli import serve

    events = []
    state = types.SimpleNamespace(config=types.SimpleNamespace(api_keys=(), model_name="m"), k=0, policy="fixed")
    monkeypatch.setattr(serve, "build_state", lambda *a, **kw: events.append("load") or state)
    monkeypatch.setattr(gcpause, "freeze_startup_heap", lambda: events.append("freeze") or 1)
    server = types.SimpleNamespace(run=lambda: events.append("run"))
    import verispec.server.app as app
    monkeypatch.setattr(app, "make_server", lambda *a, **kw: server)
    args = types.SimpleNamespace(host="127.0.0.1", port=0, log_level="error", metrics_public=False,
                                 draft=None, verify="rejection")
    assert serve._serve(args, None, None) == 0
    assert events == ["load", "freeze", "run"]
