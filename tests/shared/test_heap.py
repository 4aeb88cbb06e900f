"""What a process keeps for life is out of the collector's walks; garbage still goes."""

from __future__ import annotations

import gc

from shared import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_what_exists_is_frozen_and_later_cycles_are_still_collected():
    kept = [_Node() for _ in range(1000)]
    try:
        heap.freeze_long_lived()
        assert gc.get_freeze_count() >= len(kept)
        num_tracked = len(gc.get_objects())
        for _ in range(1000):
            _Node()  # garbage, in cycles
        gc.collect()
        assert len(gc.get_objects()) <= num_tracked + 100
    finally:
        gc.unfreeze()


def test_a_second_freeze_collects_what_the_first_held_and_was_dropped_since():
    dropped = [_Node() for _ in range(1000)]
    try:
        heap.freeze_long_lived()
        frozen_with = gc.get_freeze_count()
        del dropped  # a model a shared worker moved away from
        heap.freeze_long_lived()
        assert gc.get_freeze_count() <= frozen_with - 1000
    finally:
        gc.unfreeze()


def test_with_a_server_s_thresholds_cycles_are_still_collected_without_asking():
    before = gc.get_threshold()
    try:
        heap.freeze_long_lived()
        assert gc.get_threshold() == heap.SERVER_THRESHOLDS
        num_tracked = len(gc.get_objects())
        for _ in range(100_000):
            _Node()  # garbage in cycles: only the collector's own runs free it
        assert len(gc.get_objects()) <= num_tracked + 2 * heap.SERVER_THRESHOLDS[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
