"""The capture writer's gate (:mod:`inferscale.serving.step_gate`): it waits while the
worker runs a step, goes on once the step has ended, and never waits past its bound."""

from __future__ import annotations

import threading

from inferscale.serving.step_gate import StepGate


def test_a_waiter_goes_on_only_after_the_step_ends():
    gate = StepGate(quiet_s=0.001)
    gate.begin()
    ended = threading.Event()
    seen: list[bool] = []

    def writer() -> None:
        gate.wait_quiet(max_wait_s=60)
        seen.append(ended.is_set())

    t = threading.Thread(target=writer)
    t.start()
    t.join(timeout=0.2)
    assert t.is_alive() and not seen  # still waiting: the step runs
    ended.set()
    gate.end()
    t.join(timeout=30)
    assert seen == [True]


def test_an_idle_worker_does_not_hold_the_writer_and_a_busy_one_holds_it_at_most_max_wait():
    gate = StepGate(quiet_s=0.001)
    gate.begin()
    gate.end()
    threading.Event().wait(0.01)
    assert gate.wait_quiet(max_wait_s=60) < 30  # returned at once (well inside the bound)
    gate.begin()  # a step that never ends
    done = threading.Event()
    t = threading.Thread(target=lambda: (gate.wait_quiet(max_wait_s=0.05), done.set()))
    t.start()
    t.join(timeout=30)
    assert done.is_set()  # the bound held: the writer was not stuck behind the step
