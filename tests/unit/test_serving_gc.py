"""The master's garbage-collector settings while it serves (master.rpc.serving_gc)."""

from __future__ import annotations

import gc

import pytest

from master.rpc.serving_gc import OLDER_THRESHOLDS, YOUNG_THRESHOLD, serving_gc


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _tracked(obj: object) -> bool:
    """Whether a collection would scan `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_what_exists_is_frozen_out_of_scans_and_young_scans_are_rare() -> None:
    before_thresholds = gc.get_threshold()
    old = _Cycle()
    assert _tracked(old)
    with serving_gc():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
        assert not _tracked(old)
        new = _Cycle()
        assert _tracked(new)  # made while serving: scanned as usual
        del new
        assert gc.collect() > 0  # cyclic garbage made while serving is still freed
    assert gc.get_threshold() == before_thresholds
    assert _tracked(old)
    assert gc.get_freeze_count() == 0


def test_settings_come_back_when_the_job_raises() -> None:
    before_thresholds = gc.get_threshold()
    with pytest.raises(RuntimeError, match="job failed"):
        with serving_gc():
            raise RuntimeError("job failed")
    assert gc.get_threshold() == before_thresholds
    assert gc.get_freeze_count() == 0
