"""The client's ban book: how long failed experts and servers are avoided."""
from dmoe.client.bans import BanConfig, Bans


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
