"""``model.qsa_kv.capture_guard``: graph capture and the background readers exclude each other.

On the CPU the capture methods are driven on a stand-in class with the same two methods (the real
``torch.cuda.CUDAGraph`` needs a GPU); ``tests/gpu/test_upstream_cuda.py`` serves an FP8 cache with
the clip reader on and CUDA graphs captured, which is where the bug was seen.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from model.qsa_kv import capture_guard


class FakeGraph:
    def __init__(self):
        self.events: list[str] = []

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.events.append("begin")

    def capture_end(self):
        self.events.append("end")


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph, raising=False)
    monkeypatch.setattr(FakeGraph, "capture_begin", FakeGraph.capture_begin)
    monkeypatch.setattr(FakeGraph, "capture_end", FakeGraph.capture_end)
    monkeypatch.setattr(capture_guard, "_installed", False)
    monkeypatch.setattr(capture_guard, "_lock", threading.RLock())
    capture_guard.install()
    capture_guard.install()  # idempotent
    return FakeGraph()


def test_reader_waits_out_a_capture_and_skips_after_its_timeout(guarded):
    guarded.capture_begin(capture_error_mode="global")
    seen = []

    def reader(timeout):
        with capture_guard.gpu_access(timeout_s=timeout) as ok:
            seen.append(ok)

    t = threading.Thread(target=reader, args=(0.05,))
    t.start()
    t.join()
    assert seen == [False]  # capture in progress: the round is skipped
    waiting = threading.Thread(target=reader, args=(5.0,))
    waiting.start()
    time.sleep(0.05)
    assert waiting.is_alive()  # still waiting for the capture
    guarded.capture_end()
    waiting.join(timeout=5)
    assert seen == [False, True] and guarded.events == ["begin", "end"]


def test_capture_waits_for_a_read_in_flight(guarded):
    order = []
    inside = threading.Event()

    def reader():
        with capture_guard.gpu_access() as ok:
            assert ok
            inside.set()
            time.sleep(0.1)
            order.append("read done")

    t = threading.Thread(target=reader)
    t.start()
    inside.wait(timeout=5)
    guarded.capture_begin()
    order.append("capture began")
    guarded.capture_end()
    t.join()
    assert order == ["read done", "capture began"]


def test_a_failed_capture_begin_releases_the_lock(guarded, monkeypatch):
    def boom(self, *args, **kwargs):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(capture_guard, "_installed", False)
    monkeypatch.setattr(FakeGraph, "capture_begin", boom)
    capture_guard.install()
    with pytest.raises(RuntimeError, match="capture failed"):
        FakeGraph().capture_begin()
    with capture_guard.gpu_access(timeout_s=0.1) as ok:
        assert ok
