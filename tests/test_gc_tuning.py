"""The rollout process's garbage-collector settings (bench/driver_scale.py shows why)."""

import gc

from agentrl.rollout.gc_tuning import YOUNG_THRESHOLD, tune_gc_for_rollouts


def test_start_up_objects_are_frozen_and_young_collections_are_rarer():
    before = gc.get_threshold()
    kept = {"built at start-up": [1, 2, 3]}
    try:
        tune_gc_for_rollouts()
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD > before[0]
        assert gc.get_freeze_count() > 0
        assert all(obj is not kept for obj in gc.get_objects())  # frozen: no collection walks it
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
