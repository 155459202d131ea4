"""wait_for_experts: which calls count as answered, when the wait ends, and what gets cancelled.

Plain futures settled from other threads, as gRPC's callback threads settle them: the rule is the same whatever
the transport, and states (cancelled or not) are checked, not durations.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from dmoe.client.failures import wait_for_experts


def rows(*indices: list[int]) -> list[np.ndarray]:
    return [np.array(r, dtype=np.int64) for r in indices]


def settle_later(future: Future, gate: threading.Event, *, error: bool = False) -> threading.Thread:
    def run():
        gate.wait(10)
        if error:
            future.set_exception(RuntimeError("expert failed"))
        else:
            future.set_result(["answer"])
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_stragglers_are_cancelled_after_the_grace_once_every_row_has_k_min():
    answered, late_a, late_b = Future(), Future(), Future()
    answered.set_result(["already done before the wait"])  # its callback runs at once
    wait_for_experts([answered, late_a, late_b], rows([0, 1], [0], [1]), n_rows=2, k_min=1, timeout=30,
                     timeout_after_k_min=0.05)
    assert not answered.cancelled()
    assert late_a.cancelled() and late_b.cancelled()


def test_a_failed_call_is_no_answer_so_the_wait_goes_on_for_its_rows():
    failed, first, second = Future(), Future(), Future()
    failed.set_exception(RuntimeError("dead server"))
    first.set_result(["row 0"])
    gate = threading.Event()
    thread = settle_later(second, gate)  # row 1's only live expert answers after the wait has begun
    timer = threading.Timer(0.1, gate.set)
    timer.start()
    wait_for_experts([failed, first, second], rows([0, 1], [0], [1]), n_rows=2, k_min=1, timeout=30,
                     timeout_after_k_min=0.0)
    thread.join(5)
    assert second.done() and not second.cancelled(), "row 1 had no answer yet: the wait must not end early"


def test_the_total_timeout_ends_a_wait_nobody_answers():
    futures = [Future() for _ in range(3)]
    wait_for_experts(futures, rows([0], [0], [1]), n_rows=2, k_min=1, timeout=0.05, timeout_after_k_min=None)
    assert all(f.cancelled() for f in futures)


@pytest.mark.parametrize("k_min", [1, 2])
def test_many_answers_settled_in_a_burst_all_count(k_min):
    """A server's batch call settles all its experts at once from one thread: each answer counts once."""
    futures = [Future() for _ in range(16)]
    gate = threading.Event()

    def settle_all():
        gate.wait(10)
        for f in futures:
            f.set_result(["x"])
    thread = threading.Thread(target=settle_all, daemon=True)
    thread.start()
    gate.set()
    row_sets = rows(*[[i % 4, (i + 1) % 4] for i in range(16)])
    started = time.monotonic()
    wait_for_experts(futures, row_sets, n_rows=4, k_min=k_min, timeout=60, timeout_after_k_min=60)
    thread.join(5)
    assert all(f.done() and not f.cancelled() for f in futures)
    assert time.monotonic() - started < 30, "the wait must end when the last answer is in, not at its timeout"


def test_the_wait_names_the_calls_it_cut_at_the_grace_but_not_those_past_its_timeout():
    """Review 65: the layer drops a straggler cut by the grace from that forward only, and bans the server of a call
    that missed the forward's own deadline: the wait tells them apart."""
    answered, late = Future(), Future()
    answered.set_result(["row 0"])
    assert wait_for_experts([answered, late], rows([0], [0]), n_rows=1, k_min=1, timeout=30,
                            timeout_after_k_min=0.05) == [1]
    assert late.cancelled()
    nobody = [Future(), Future()]  # k_min never reached: the total timeout ends the wait
    assert wait_for_experts(nobody, rows([0], [1]), n_rows=2, k_min=1, timeout=0.05, timeout_after_k_min=0.01) == []
    assert all(f.cancelled() for f in nobody)
    answered, late = Future(), Future()
    answered.set_result(["row 0"])  # a grace longer than the time left: the timeout ends the wait
    assert wait_for_experts([answered, late], rows([0], [0]), n_rows=1, k_min=1, timeout=0.05,
                            timeout_after_k_min=30) == []
    assert late.cancelled()
