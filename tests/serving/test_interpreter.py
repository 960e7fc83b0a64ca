"""kev/serving/interpreter.py: the start-up heap frozen out of GC scans, and the GIL switch interval."""

import gc
import sys

import pytest

from kev.serving.interpreter import freeze_startup_heap, set_switch_interval


def test_freeze_moves_the_live_heap_out_of_collections():
    alive = [object() for _ in range(1000)]
    try:
        frozen = freeze_startup_heap()
        # not equal: another test's background thread may free a frozen object meanwhile
        assert frozen >= len(alive) and gc.get_freeze_count() >= len(alive)
        assert not any(o is alive for o in gc.get_objects())  # frozen objects are not in any generation
        later = [[]]  # allocated after the freeze: still collected as before
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_switch_interval_set_kept_at_zero_and_negative_refused():
    before = sys.getswitchinterval()
    try:
        assert set_switch_interval(0.5) == pytest.approx(0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert set_switch_interval(0) == pytest.approx(0.5)  # 0 leaves the interval in force
        with pytest.raises(ValueError, match=">= 0"):
            set_switch_interval(-1)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
