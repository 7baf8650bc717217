"""Admission on a second use (``kv_admission_window_s``, :mod:`inferscale.kv.admission`): the
rule itself, on a clock the test moves. Its effect on the real engine (a first miss not
captured, the second captured) is in tests/test_capture.py."""

from __future__ import annotations

import threading

import pytest

from inferscale.config import MemoryConfig
from inferscale.kv.admission import SecondUseAdmission


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_miss_is_kept_on_its_second_use_within_the_window_only():
    clock = Clock()
    rule = SecondUseAdmission(60, clock=clock)
    assert rule.admit(["a", "b"]) == [False, False]
    clock.now += 59
    assert rule.admit(["a", "c"]) == [True, False]  # a: second within 60 s; c: first
    clock.now += 61
    assert rule.admit(["b", "c"]) == [False, False]  # b: 120 s after its first; c: 61 s
    assert rule.admit(["b"]) == [True]  # the late miss started a new window
    assert rule.admit(["a"]) == [False]  # kept once, forgotten: a later miss starts over
    assert (rule.admitted, rule.refused) == (2, 6)


def test_without_pressure_every_miss_is_kept_and_nothing_remembered():
    rule = SecondUseAdmission(60, clock=Clock())
    assert rule.admit(["a", "b"], pressure=False) == [True, True]
    assert rule.admit(["a"]) == [False]  # under pressure now: a first miss (the earlier one was kept)


def test_window_zero_keeps_every_miss_and_remembers_nothing():
    rule = SecondUseAdmission(0)
    assert not rule.enabled
    assert rule.admit(["a", "a", "b"]) == [True, True, True]
    assert (rule.admitted, rule.refused) == (3, 0)


def test_the_oldest_first_misses_are_forgotten_past_the_bound():
    rule = SecondUseAdmission(60, max_remembered=2, clock=Clock())
    rule.admit(["a", "b", "c"])  # a is forgotten
    assert rule.admit(["a", "c"]) == [False, True]


def test_concurrent_misses_of_one_memory_keep_it_once_per_pair():
    rule = SecondUseAdmission(3600)
    results: list[bool] = []
    lock = threading.Lock()

    def miss() -> None:
        for _ in range(500):
            (keep,) = rule.admit(["m"])
            with lock:
                results.append(keep)

    threads = [threading.Thread(target=miss) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == results.count(False) == 1000  # strictly alternating under the lock


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "soon"])
def test_a_bad_window_is_refused_with_its_name(bad):
    with pytest.raises((TypeError, ValueError), match="kv_admission_window_s|admission window"):
        MemoryConfig(kv_admission_window_s=bad)
    if not isinstance(bad, (bool, str)):
        with pytest.raises(ValueError, match="admission window"):
            SecondUseAdmission(bad)

