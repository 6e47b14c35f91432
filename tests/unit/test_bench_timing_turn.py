"""The real-shape bench's timing lock: an engine times only once no other holder of the lock file
is still starting (holding it shared), so engines started side by side on one GPU are timed one
at a time on an otherwise idle GPU."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_real_shape.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_real_shape", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_timing_waits_for_every_engine_still_starting(tmp_path: Path) -> None:
    bench = load_bench()
    lock = str(tmp_path / "timing.lock")
    starting, ready = bench.TimingTurn(lock), bench.TimingTurn(lock)
    timed = threading.Event()

    def time_ready_engine() -> None:
        with ready.timing():
            timed.set()

    worker = threading.Thread(target=time_ready_engine)
    worker.start()
    assert not timed.wait(0.5), "an engine timed while another still held the lock shared (starting)"
    with starting.timing():  # the other engine has started: it gives up its shared hold and times
        pass
    worker.join(timeout=30)
    assert timed.is_set()


def test_without_a_lock_file_timing_is_immediate() -> None:
    turn = load_bench().TimingTurn(None)
    with turn.timing():
        pass
