"""The client's ban book: how long failed experts and servers are avoided, and which failures ban."""
from concurrent.futures import Future

import grpc
import torch

from dmoe.client.bans import BanConfig, Bans
from dmoe.client.failures import REFUSALS_TO_BAN, CallPolicy
from dmoe.client.remote_expert import RemoteExpertError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_server_failing_every_call_of_one_step_is_banned_once_and_doubles_only_when_it_fails_again():
    clock = Clock()
    bans = Bans(BanConfig(initial_backoff=1.0, max_backoff=60.0), clock=clock)
    # a dead server fails the calls of all 8 experts a step chose there: one incident, one initial backoff
    assert [bans.fail(endpoint="a:1") for _ in range(8)] == [1.0] * 8
    assert bans.is_banned("ffn0.0.0", "a:1") and not bans.is_banned("ffn0.0.0", "b:2") and len(bans) == 1
    clock.now += 1.5  # the ban ran out: the server is tried again, and fails again
    assert not bans.is_banned("ffn0.0.0", "a:1")
    assert bans.fail(endpoint="a:1") == 2.0 and bans.fail(endpoint="a:1") == 2.0
    for expected in (4.0, 8.0, 16.0, 32.0, 60.0, 60.0):
        clock.now += 100
        assert bans.fail(endpoint="a:1") == expected
    bans.succeed("ffn0.0.0", "a:1")  # one answer re-admits the server with a clean record
    assert not bans.is_banned("ffn0.0.0", "a:1") and bans.fail(endpoint="a:1") == 1.0


def test_an_expert_ban_leaves_the_other_experts_of_its_server_alone():
    bans = Bans(clock=Clock())
    bans.fail(uid="ffn0.1.2")
    assert bans.is_banned("ffn0.1.2", "a:1") and not bans.is_banned("ffn0.1.3", "a:1")


def failed(code: grpc.StatusCode) -> Future:
    future = Future()
    future.set_exception(RemoteExpertError("ffn0.1.2", "a:1", code, "input 0: expected shape [*, 16]"))
    return future


def test_a_refusal_as_invalid_drops_the_expert_but_neither_bans_nor_readmits_it():
    clock = Clock()
    policy = CallPolicy(bans=Bans(clock=clock))
    assert policy.outcome("ffn0.1.2", "a:1", failed(grpc.StatusCode.INVALID_ARGUMENT)) is None
    assert policy.outcome("ffn0.1.2", "a:1", failed(grpc.StatusCode.INVALID_ARGUMENT), backward=True) is None
    assert len(policy.bans) == 0 and policy.stats.backward_failures == 1
    assert policy.refusing == {"ffn0.1.2"} and "expected shape" in policy.refused
    assert policy.outcome("ffn0.1.2", "a:1", failed(grpc.StatusCode.INTERNAL)) is None  # a real failure still bans
    assert policy.bans.is_banned("ffn0.1.2", "a:1")
    clock.now += 1.5
    policy.outcome("ffn0.1.2", "a:1", failed(grpc.StatusCode.INVALID_ARGUMENT))  # the record stays: next ban doubles
    assert policy.bans.fail(uid="ffn0.1.2") == 2.0


def answered() -> Future:
    future = Future()
    future.set_result([torch.zeros(2, 16)])
    return future


def test_only_an_expert_refusing_in_a_row_what_other_experts_answered_is_banned():
    policy = CallPolicy(bans=Bans(clock=Clock()))
    refused = [("ffn0.1.2", "a:1")]
    for _ in range(5):  # every expert refused: the caller's own mistake, however often
        policy.weigh_refusals(refused, others_answered=False)
    assert len(policy.bans) == 0 and not policy.refusal_streaks
    policy.weigh_refusals(refused, others_answered=True)
    policy.weigh_refusals(refused, others_answered=True)
    policy.outcome("ffn0.1.2", "a:1", answered())  # an answer ends the streak
    for _ in range(REFUSALS_TO_BAN - 1):
        policy.weigh_refusals(refused, others_answered=True)
    assert len(policy.bans) == 0
    policy.weigh_refusals(refused, others_answered=True)
    assert policy.bans.is_banned("ffn0.1.2") and not policy.bans.is_banned("ffn0.1.3", "a:1")
    assert not policy.refusal_streaks


def test_a_forward_answer_does_not_clear_a_backward_failure_so_its_backoff_grows():
    """Review 46: a server answering forwards at once and no backward in time had its ban record cleared by every
    forward, and cost the caller its backward timeout every other step with a backoff stuck at the first one."""
    clock = Clock()
    bans = Bans(BanConfig(initial_backoff=1.0, max_backoff=60.0), clock=clock)
    for expected in (1.0, 2.0, 4.0):
        assert bans.fail(endpoint="a:1", backward=True) == expected
        assert bans.is_banned("ffn0.0.0", "a:1")
        clock.now += expected + 0.1
        assert not bans.is_banned("ffn0.0.0", "a:1")
        bans.succeed("ffn0.0.0", "a:1")  # its next forward answers
    bans.fail(endpoint="a:1")  # a forward failure is its own record, cleared by a forward's answer
    bans.succeed("ffn0.0.0", "a:1")
    assert not bans.is_banned("ffn0.0.0", "a:1") and bans.fail(endpoint="a:1", backward=True) == 8.0
    clock.now += 100
    bans.succeed("ffn0.0.0", "a:1", backward=True)  # a backward's answer clears both
    assert bans.fail(endpoint="a:1", backward=True) == 1.0


def test_records_of_long_expired_bans_are_forgotten_once_there_are_many(monkeypatch):
    from dmoe.client import bans as bans_module

    monkeypatch.setattr(bans_module, "MAX_RECORDS", 10)
    clock = Clock()
    bans = Bans(BanConfig(initial_backoff=1.0, max_backoff=5.0), clock=clock)
    for i in range(11):
        bans.fail(uid=f"gone.{i}")
    clock.now += 10  # every ban ran out longer ago than the longest backoff
    bans.fail(uid="new")
    assert len(bans._bans) == 1 and bans.is_banned("new")


def test_backward_refusals_in_a_row_that_others_answer_ban_the_expert_apart_from_forward_ones():
    policy = CallPolicy(bans=Bans(clock=Clock()))
    refused = [("ffn0.0.1", "b:2")]
    for _ in range(REFUSALS_TO_BAN - 1):
        policy.weigh_refusals(refused, others_answered=True, backward=True)
        policy.weigh_refusals(refused, others_answered=True)
    assert len(policy.bans) == 0
    policy.weigh_refusals(refused, others_answered=True, backward=True)
    assert policy.bans.is_banned("ffn0.0.1") and "forward ffn0.0.1" in policy.refusal_streaks
