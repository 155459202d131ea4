"""The pieces of collaborative training one at a time: progress records and what is refused, the canonical lineage
and whom to download from, the state's encoding, checks and gRPC service, and the progress tracker on a real DHT
(a bootstrap node in its own process). The trainers together are in tests/test_collab.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import json
import logging
import math
import re
import socket
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator

import grpc
import pytest
import torch

from dmoe import DHT, CollaborationConfig
from dmoe.collab import optimizer as collab_optimizer
from dmoe.collab.optimizer import CollaborativeOptimizer, parameters_lineage
from dmoe.collab.progress import (
    ACCUMULATING,
    AVERAGING,
    GONE,
    MAX_GROUP_SIZE,
    RECORD_MAX_STEP,
    CollaborationState,
    Progress,
    ProgressTracker,
    canonical_lineage,
    check_record_fits,
    progress_key,
    refusal,
)
from dmoe.collab.state_sync import (
    StateDownloadError,
    StateMismatch,
    StateServer,
    StateServicer,
    TrainingState,
    check_state,
    decode_state,
    download_limits,
    download_state,
    encode_state,
    load_state,
)
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc, grpc_options
from tests.procs import running
from tests.test_endpoints import needs_ipv6

torch.set_num_threads(1)
CONFIG = CollaborationConfig(target_batch_size=100, refresh_period=0.2, progress_ttl=2.0)


def progress(step=3, samples=10, speed=5.0, stamp=None, endpoint="127.0.0.1:5000", phase=ACCUMULATING,
             lineage="0123abcd", group_size=3) -> Progress:
    return Progress(step, samples, speed, time.time() if stamp is None else stamp, endpoint, phase, lineage,
                    group_size)


# ---- records ----
def test_a_progress_record_survives_encoding_and_fits_a_dht_value():
    record = progress(step=123456, samples=4096, speed=1234.5678, endpoint="[::1]:65535")
    value = record.encode()
    assert len(value) <= 96 and " " not in value
    parsed = Progress.parse(value)
    assert parsed == Progress(123456, 4096, float(f"{1234.5678:.4g}"), round(record.time, 2), "[::1]:65535",
                              ACCUMULATING, "0123abcd", 3)
    assert Progress.parse(progress(endpoint=None).encode()).endpoint is None


def test_a_record_is_checked_to_fit_up_to_a_billion_steps_and_a_full_length_ipv6_endpoint_is_refused():
    for endpoint in ("255.255.255.255:65535", "[2a02:8071:5e80:1a40::4e1d]:65535", None):
        check_record_fits(7, progress(endpoint=endpoint), CONFIG, 96)
        worst = progress(step=RECORD_MAX_STEP, samples=int(CONFIG.max_samples), speed=9.999e99,
                         stamp=9999999999.99, endpoint=endpoint, group_size=MAX_GROUP_SIZE)
        assert len(worst.encode()) <= 96
    full = "[2a02:8071:5e80:1a40:d1c3:9a2b:7f10:4e1d]:43123"
    with pytest.raises(ValueError, match="--averaging-host and --state-port.*--averaging-client-mode"):
        check_record_fits(7, progress(step=0, samples=0, endpoint=full), CONFIG, 96)


@pytest.mark.parametrize("value", [
    "1;2;3", "x;2;3.0;1.0;-;a;0123abcd;1", "1;-2;3.0;1.0;-;a;0123abcd;1", "1;2;3.0;1.0;-;q;0123abcd;1",
    "1;2;3.0;1.0;-;a;XYZ;1", "1;2;3.0;1.0;host:0;a;0123abcd;1", "1;2;fast;1.0;-;a;0123abcd;1",
    # gRPC targets that are no HOST:PORT: a unix socket of the reader's machine (review 99 D3)
    "1;2;3.0;1.0;unix:1234;a;0123abcd;1", "1;2;3.0;1.0;unix:/run/x.sock:1;a;0123abcd;1",
])
def test_malformed_progress_values_are_refused(value):
    with pytest.raises(ValueError):
        Progress.parse(value)


def test_absurd_samples_a_future_stamp_or_a_bad_speed_are_refused_with_a_reason():
    now = time.time()
    assert refusal(progress(samples=1000), CONFIG, now) is None  # 10 target batches: the limit itself
    kind, message = refusal(progress(samples=1001), CONFIG, now)
    assert kind == "samples" and "1001 samples toward step 3" in message
    kind, message = refusal(progress(stamp=now + 3600), CONFIG, now)
    assert kind == "future" and "3600 s in the future" in message
    assert refusal(progress(stamp=now + 10), CONFIG, now) is None  # within the clock skew allowed
    assert refusal(progress(speed=-1.0), CONFIG, now)[0] == "speed"
    assert refusal(progress(speed=math.inf), CONFIG, now)[0] == "speed"
    assert refusal(progress(group_size=10_000), CONFIG, now)[0] == "group"


# ---- the canonical lineage, partners, readiness and whom to download from ----
def test_the_canonical_lineage_is_the_largest_groups_then_the_most_held_then_the_smallest():
    a, b, c = "aaaaaaaa", "bbbbbbbb", "cccccccc"
    assert canonical_lineage({1: progress(lineage=b, group_size=3), 2: progress(lineage=a, group_size=2),
                              3: progress(lineage=a, group_size=2)}) == b
    assert canonical_lineage({1: progress(lineage=b, group_size=1), 2: progress(lineage=c, group_size=1),
                              3: progress(lineage=c, group_size=1)}) == c
    assert canonical_lineage({1: progress(lineage=c, group_size=1), 2: progress(lineage=b, group_size=1)}) == b
    assert canonical_lineage({}) is None


def test_among_lineages_of_trainers_that_stepped_alone_one_that_is_served_wins():
    """Every trainer of a step stepped alone: a client-mode trainer's lineage won on its name, nobody could download
    it, and it and the serving trainer stopped being partners (review 77)."""
    a, b = "aaaaaaaa", "bbbbbbbb"
    client, serving = progress(lineage=a, group_size=1, endpoint=None), progress(lineage=b, group_size=1)
    assert canonical_lineage({1: client, 2: serving}) == b
    assert state(client, {2: serving}).source() == (2, serving)  # the client-mode trainer downloads it
    assert state(serving, {1: client}).source() is None
    # the group's size and the count still come first
    assert canonical_lineage({1: replace(client, group_size=2), 2: serving}) == a


def state(me: Progress, peers: dict[int, Progress], target: int = 100) -> CollaborationState:
    return CollaborationState(me, 1, peers, target, time.time())


def test_partners_share_the_step_and_lineage_and_their_samples_count_toward_the_target():
    me = progress(samples=30)
    peers = {2: progress(samples=40, speed=0.0), 3: progress(samples=25, speed=0.0),
             4: progress(step=2, samples=90), 5: progress(lineage="ffffffff", samples=90)}
    view = state(me, peers)
    assert set(view.partners) == {2, 3}
    assert view.samples_accumulated == 95 and not view.ready
    assert state(progress(samples=35), peers).ready
    # the estimate extrapolates partners' samples at their speed since they published; readiness takes reports
    moving = {2: progress(samples=40, speed=10.0, stamp=time.time() - 1.0)}
    assert state(progress(samples=55), moving).samples_estimate == pytest.approx(105, abs=0.5)
    assert not state(progress(samples=55), moving).ready
    assert state(progress(samples=30, speed=6.0), {2: progress(samples=10, speed=0.0)}).eta == pytest.approx(10.0)
    assert state(progress(samples=30, speed=0.0), {2: progress(samples=10, speed=0.0)}).eta == math.inf
    # a partner that started averaging saw the target reached: join it
    assert state(progress(samples=1), {2: progress(samples=1, phase=AVERAGING)}).ready


def test_a_trainer_behind_or_off_the_canonical_lineage_downloads_from_one_on_it():
    on = progress(step=5, lineage="aaaaaaaa", group_size=3)
    assert state(on, {2: on, 3: on}).source() is None
    behind = state(progress(step=3, lineage="aaaaaaaa"), {2: on, 3: progress(step=5, lineage="bbbbbbbb",
                                                                            group_size=1)})
    assert behind.source()[0] == 2
    # at the top step, but from a smaller group than the others': theirs wins
    off = state(progress(step=5, lineage="cccccccc", group_size=1), {2: on, 3: on})
    assert off.source()[0] in (2, 3)
    # only trainers that serve their state can be downloaded from
    assert state(progress(step=3), {2: progress(step=5, endpoint=None)}).source() is None
    # nobody else: a collaboration of one is always on its own lineage
    assert state(progress(step=0), {}).source() is None


def test_trainers_above_the_serving_ones_do_not_keep_a_joiner_from_downloading():
    joiner = progress(step=0, lineage="00000000", group_size=0)
    serving = {1: progress(step=50, endpoint="127.0.0.1:2"), 2: progress(step=50, endpoint="127.0.0.1:3")}
    claims = {3: progress(step=10**9, endpoint=None, lineage="bbbbbbbb", group_size=1)}  # client mode, or a lie
    assert state(joiner, {**serving, **claims}).source()[0] in (1, 2)
    # the highest serving step wins over a lower one
    lower = {4: progress(step=20, endpoint="127.0.0.1:4")}
    assert state(joiner, {**serving, **claims, **lower}).source()[0] in (1, 2)
    # at that step the canonical lineage is the one of everyone there; when no server holds it, a trainer behind
    # takes the servers' own rather than stay behind ...
    at_50 = {1: progress(step=50, endpoint="127.0.0.1:2", lineage="cccccccc", group_size=1),
             5: progress(step=50, endpoint=None, lineage="aaaaaaaa", group_size=3)}
    assert state(joiner, at_50).source()[0] == 1
    assert state(joiner, {**at_50, 6: progress(step=50, endpoint="127.0.0.1:6", lineage="aaaaaaaa")}
                 ).source()[0] == 6
    # ... but one at that step never swaps its lineage for another non-canonical one, nor goes back
    assert state(progress(step=50, lineage="dddddddd", group_size=1), at_50).source() is None
    assert state(progress(step=60), serving).source() is None


# ---- the state: encoding, checks, loading ----
def trained(seed: int = 0, hidden: int = 6) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_state_survives_encoding_in_parts_and_loads_into_a_fresh_optimizer():
    model, opt = trained(seed=0)
    captured = TrainingState.capture(7, "0123abcd", 3, list(model.parameters()), opt)
    messages = encode_state(captured, "run", part_bytes=32)  # every tensor cut into several parts
    assert len(messages) > len(captured.parameters) * 3
    decoded = decode_state(messages, max_bytes=1 << 20)
    assert (decoded.step, decoded.lineage, decoded.group_size) == (7, "0123abcd", 3)
    fresh, fresh_opt = trained(seed=1)
    load_state(decoded, list(fresh.parameters()), fresh_opt)
    for mine, theirs in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(mine, theirs)
    for index, entry in opt.state_dict()["state"].items():
        loaded = fresh_opt.state_dict()["state"][index]
        assert all(torch.equal(loaded[key], value) for key, value in entry.items())
    assert fresh_opt.param_groups[0]["lr"] == 0.01


def test_a_state_of_another_model_is_refused_naming_the_difference_and_nothing_is_written():
    small, small_opt = trained(hidden=6)
    big, big_opt = trained(hidden=8)
    theirs = decode_state(encode_state(TrainingState.capture(1, "0123abcd", 2, list(big.parameters()), big_opt),
                                       "run"), 1 << 20)
    before = [p.detach().clone() for p in small.parameters()]
    with pytest.raises(StateMismatch, match=r"parameter 0 has shape \[8, 4\] in the state, \[6, 4\] here"):
        load_state(theirs, list(small.parameters()), small_opt)
    assert all(torch.equal(p, q) for p, q in zip(small.parameters(), before))
    with pytest.raises(StateMismatch, match="the state holds 4 parameter tensors, this model 2"):
        check_state(theirs, list(small.parameters())[:2], small_opt)
    poisoned = TrainingState.capture(1, "0123abcd", 2, list(small.parameters()), small_opt)
    poisoned.parameters[1][0] = float("nan")
    with pytest.raises(StateMismatch, match="parameter 1 holds NaN or Inf"):
        check_state(poisoned, list(small.parameters()), small_opt)


def test_a_malformed_state_stream_is_refused():
    model, opt = trained()
    messages = encode_state(TrainingState.capture(1, "0123abcd", 2, list(model.parameters()), opt), "run")
    with pytest.raises(StateDownloadError, match="tensors"):
        decode_state(messages[:-1], 1 << 20)  # a tensor missing
    with pytest.raises(StateDownloadError, match="exceed"):
        decode_state(messages, 64)
    messages[1].name = "weights.9"
    with pytest.raises(StateDownloadError, match="unexpected tensor 'weights.9'"):
        decode_state(messages, 1 << 20)
    with pytest.raises(StateDownloadError, match="empty"):
        decode_state([], 1 << 20)


def test_the_state_service_serves_its_run_and_refuses_others_with_a_clear_status():
    model, opt = trained()
    encoded = encode_state(TrainingState.capture(4, "0123abcd", 2, list(model.parameters()), opt), "run")
    served = {"messages": None}
    with StateServer(StateServicer("run", lambda: served["messages"])) as server:
        with pytest.raises(StateDownloadError, match="UNAVAILABLE: this trainer has no state to give yet"):
            download_state(server.endpoint, "run", timeout=10, max_bytes=1 << 20)
        served["messages"] = encoded
        assert download_state(server.endpoint, "run", timeout=10, max_bytes=1 << 20).step == 4
        with pytest.raises(StateDownloadError, match="NOT_FOUND: this trainer is in run 'run', not 'other'"):
            download_state(server.endpoint, "other", timeout=10, max_bytes=1 << 20)
        with pytest.raises(StateDownloadError, match="RESOURCE_EXHAUSTED.*larger than max"):  # one message: 423 B
            download_state(server.endpoint, "run", timeout=10, max_bytes=100)
    with pytest.raises(StateDownloadError, match="UNAVAILABLE"):
        download_state(server.endpoint, "run", timeout=5, max_bytes=1 << 20)  # the server is gone


@needs_ipv6
def test_downloads_never_read_hold_no_thread_are_capped_per_machine_and_cut_at_the_servers_deadline():
    """A client that opens downloads and never reads them (HTTP/2 flow control then stalls them) once held both
    threads of the server for good: every joiner timed out and banned an honest trainer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 1024)  # a state of 24 MiB: gRPC sends ~6 MiB to a client that does not read
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    encoded = encode_state(TrainingState.capture(4, "0123abcd", 2, list(model.parameters()), opt), "run")
    limits = download_limits(list(model.parameters()))
    servicer = StateServicer("run", lambda: encoded, timeout=3.0, max_per_host=2)
    with StateServer(servicer, host="::") as server:
        port = server.endpoint.rpartition(":")[2]
        honest = f"127.0.0.1:{port}"
        started = time.monotonic()
        assert download_state(honest, "run", 10, *limits).step == 4
        alone = time.monotonic() - started
        with grpc.insecure_channel(f"[::1]:{port}", options=grpc_options()) as channel:  # another machine
            stub = dmoe_pb2_grpc.CollaborationServiceStub(channel)
            calls = [stub.download_state(dmoe_pb2.StateRequest(run_id="run")) for _ in range(3)]  # never read
            wait_until(lambda: sum(call.done() for call in calls) == 1)
            refused = next(call for call in calls if call.done())
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert re.fullmatch(r"::/64 has 2 state downloads from this trainer in progress already, the most one "
                                r"machine may have at once; try again once one ends", refused.details())
            assert servicer.in_progress() == {"::/64": 2}
            started = time.monotonic()
            assert download_state(honest, "run", 10, *limits).step == 4  # in its usual time, not the deadline's
            assert time.monotonic() - started < alone + 1.5
            servicer.max_downloads = 2  # every place taken: refused, naming why
            with pytest.raises(StateDownloadError, match="RESOURCE_EXHAUSTED: this trainer serves 2 state "
                                                         "downloads already, its most at once; try again later"):
                download_state(honest, "run", 10, *limits)
            servicer.max_downloads = 32
            # the server's deadline (3 s, gRPC's connection age within 10%, then a second of grace) ends them
            wait_until(lambda: not servicer.in_progress(), timeout=15)
            assert time.monotonic() - started < 10
            for call in calls:  # what reached this client before, then the end the server gave the stream
                with pytest.raises(grpc.RpcError) as ended:
                    sum(1 for _ in call)
                assert ended.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    or call is refused
        assert download_state(f"[::1]:{port}", "run", 10, *limits).step == 4  # that machine is served again


def adam(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def sent(mutate) -> TrainingState:
    """A state as a peer that changed it before encoding would serve it."""
    model, opt = adam(seed=1)
    captured = TrainingState.capture(5, "0123abcd", 2, list(model.parameters()), opt)
    mutate(captured)
    return decode_state(encode_state(captured, "run"), 1 << 20)


def changed(attribute: str, *keys, value):
    """A change a peer makes to its state before encoding it: ``state.<attribute>[keys...] = value``."""
    def mutate(captured: TrainingState) -> None:
        if not keys:
            setattr(captured, attribute, value)
            return
        target = getattr(captured, attribute)
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return mutate


def only_steps(captured: TrainingState) -> None:
    """Optimizer entries that hold only Adam's ``step``, not its moments."""
    captured.optimizer["state"] = {index: {"step": entry["step"]}
                                   for index, entry in captured.optimizer["state"].items()}


@pytest.mark.parametrize("mutate, refused", [
    (changed("optimizer", "state", 0, "exp_avg", value=torch.zeros(1)),
     r"'exp_avg' of parameter 0 has shape \[1\] in the state, the parameter \[3, 4\] here"),
    (changed("optimizer", "state", 1, "exp_avg_sq", value=torch.zeros(())),
     r"'exp_avg_sq' of parameter 1 has shape \[\]"),
    (changed("optimizer", "state", 0, "exp_avg", value=torch.zeros(3, 4, dtype=torch.int64)), "not floating point"),
    (changed("optimizer", "state", 0, "step", value=torch.tensor(-1.0)),
     r"'step' of parameter 0 is -1.0, not a finite number >= 0"),
    (changed("optimizer", "state", 0, "step", value=torch.tensor(float("nan"))), "'step' of parameter 0 is nan"),
    (changed("optimizer", "state", 0, "step", value=torch.ones(2)), "'step' of parameter 0 is not a real scalar"),
    (changed("optimizer", "state", 1, "step", value=3.0), "'step' of parameter 1 is not a tensor in the state"),
    (changed("optimizer", "state", 1, "extra", value=1), r"parameter 1 holds \['exp_avg', 'exp_avg_sq', 'extra'"),
    (only_steps, r"parameter 0 holds \['step'\] in the state, \['exp_avg', 'exp_avg_sq', 'step'\] here"),
    (changed("optimizer", "state", 1, "exp_avg_sq", value=-torch.ones(3)),  # finite: Adam's sqrt makes it NaN
     "a trial step of this Adam from the state turns parameter 1 into NaN or Inf"),
    (changed("optimizer", "state", 7, value={"foo": 1.0}), "names parameter 7; this model has 2"),
    (changed("optimizer", "param_groups", 0, "params", value=2), r"groups differ: params \[2\] in the state"),
    (changed("optimizer", "param_groups", 0, "params", value=[1, 0]),
     r"params \[\[1, 0\]\] in the state, \[\[0, 1\]\] here"),
    (changed("optimizer", "param_groups", value=[{"params": [0]}, {"params": [1]}]),
     r"groups differ: params \[\[0\], \[1\]\] in the state"),
    (changed("lineage", value="has space;" + "x" * 100), "lineage 'has space;xxx.* is malformed"),
    (changed("group_size", value=10**6), "averaged by 1000000 trainers"),
])
def test_a_state_this_optimizer_could_not_step_with_is_refused_before_anything_is_written(mutate, refused):
    model, opt = adam(seed=0)
    parameters = list(model.parameters())
    before = [p.detach().clone() for p in parameters]
    state_before = {i: {k: v.clone() for k, v in entry.items()}
                    for i, entry in opt.state_dict()["state"].items()}
    with pytest.raises(StateMismatch, match=refused):
        load_state(sent(mutate), parameters, opt)
    assert all(torch.equal(p, q) for p, q in zip(parameters, before))
    for index, entry in opt.state_dict()["state"].items():
        assert all(torch.equal(value, state_before[index][key]) for key, value in entry.items())


@pytest.mark.parametrize("mutate, refused", [
    (only_steps, r"the optimizer's state of parameter 0 holds \['step'\] in the state, \['exp_avg', 'exp_avg_sq', "
                 r"'step'\] here"),  # once loaded, and the joiner's next step raised KeyError 'exp_avg'
    (changed("optimizer", "state", 1, "extra", value=1.0),
     r"parameter 1 holds \['exp_avg', 'exp_avg_sq', 'extra', 'step'\] in the state, \['exp_avg', 'exp_avg_sq', "
     r"'step'\] here"),
    (changed("optimizer", "state", 0, "step", value=3.0),
     "'step' of parameter 0 is not a tensor in the state, one here"),
    (changed("optimizer", "state", 0, "exp_avg_sq", value=-torch.ones(3, 4)),  # once loaded, and NaN a step later
     "a trial step of this Adam from the state turns parameter 0 into NaN or Inf"),
], ids=["only steps", "an extra key", "a number step", "a negative second moment"])
def test_a_fresh_optimizer_refuses_a_state_it_could_not_step_with_and_holds_none_after(mutate, refused):
    """A joiner's optimizer holds no state yet: the keys and kinds it would hold come from a step of a fresh copy
    of it, and a trial step from the state says whether it could step with it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StateMismatch, match=refused):
        load_state(sent(mutate), list(model.parameters()), opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not opt.state and all(p.grad is None for p in model.parameters())


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "Adam amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "SGD nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "RMSprop centered": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_an_honest_state_is_taken_exactly_as_before_the_trial_steps(make):
    """The checks step copies only: the state loaded, and every step after, are bit for bit what loading it
    without them gives, into a fresh optimizer and into one with state of its own."""
    def batch(model: torch.nn.Module, seed: int) -> None:
        torch.manual_seed(seed)
        model.zero_grad()
        model(torch.randn(2, 4)).pow(2).sum().backward()

    torch.manual_seed(0)
    source = torch.nn.Linear(4, 3)
    source_opt = make(source.parameters())
    for seed in range(2):
        batch(source, seed)
        source_opt.step()
    state = decode_state(encode_state(TrainingState.capture(2, "0123abcd", 1, list(source.parameters()),
                                                            source_opt), "run"), 1 << 20)
    as_sent = copy.deepcopy(state)
    for own_state in (False, True):
        models = [torch.nn.Linear(4, 3) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        opts = [make(model.parameters()) for model in models]
        if own_state:
            for model, opt in zip(models, opts):
                batch(model, 5)
                opt.step()
        checked, plain = copy.deepcopy(state), copy.deepcopy(state)
        load_state(checked, list(models[0].parameters()), opts[0])
        assert all(torch.equal(a, b) for a, b in zip(checked.parameters, as_sent.parameters))
        assert all(torch.equal(value, as_sent.optimizer["state"][index][key]) if torch.is_tensor(value)
                   else value == as_sent.optimizer["state"][index][key]
                   for index, entry in checked.optimizer["state"].items() for key, value in entry.items())
        # what load_state did before it took trial steps
        opts[1].load_state_dict({"param_groups": opts[1].state_dict()["param_groups"],
                                 "state": plain.optimizer["state"]})
        with torch.no_grad():
            for mine, theirs in zip(models[1].parameters(), plain.parameters):
                mine.copy_(theirs)
        for seed in range(10, 13):
            for model, opt in zip(models, opts):
                batch(model, seed)
                opt.step()
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
        for a, b in zip(opts[0].state_dict()["state"].values(), opts[1].state_dict()["state"].values()):
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) if torch.is_tensor(a[key])
                                                else a[key] == b[key] for key in a)


class Needy(torch.optim.SGD):
    """An optimizer whose constructor needs an argument torch's do not take: no trial copy of it can be made."""

    def __init__(self, params, secret: str, lr: float = 0.1):
        super().__init__(params, lr=lr, momentum=0.9)
        self.secret = secret


class Broken(torch.optim.SGD):
    """An optimizer that cannot step even from fresh state: a failure of a trial is its own, not the state's."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9):
        super().__init__(params, lr=lr, momentum=momentum)

    def step(self, closure=None):
        raise RuntimeError("this optimizer fails whatever its state")


@pytest.mark.parametrize("make, logged", [
    (lambda ps: Needy(ps, "s"), r"this Needy: it cannot be copied \(TypeError: .*'secret'\)"),
    (Broken, "this Broken: a trial step of this Broken from fresh state failed: RuntimeError: this optimizer fails "
             "whatever its state"),
], ids=["cannot be copied", "cannot step from fresh state"])
def test_a_state_for_an_optimizer_without_trial_steps_is_taken_on_the_other_checks_and_that_is_logged(
        make, logged, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = decode_state(encode_state(TrainingState.capture(1, "0123abcd", 1, list(model.parameters()), opt),
                                      "run"), 1 << 20)
    joiner = torch.nn.Linear(4, 3)
    joiner_opt = make(joiner.parameters())
    with caplog.at_level(logging.WARNING, logger="dmoe.collab"):
        load_state(state, list(joiner.parameters()), joiner_opt)
    assert all(torch.equal(a, b) for a, b in zip(joiner.parameters(), model.parameters()))
    assert torch.equal(joiner_opt.state[joiner.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])
    assert re.search(rf"a downloaded state cannot be checked by a trial step of {logged}; it is checked for shapes, "
                     rf"kinds and finite values only", caplog.text), caplog.text


def test_a_failed_trial_is_the_optimizers_own_only_when_a_fresh_step_over_the_trainers_parameters_fails_too():
    """Finite parameters the sender chose (1e30) overflow even a step from fresh state (Adam's L2 weight decay
    squares 1e29): the fresh step that tells an optimizer's own failures from the state's uses this trainer's
    parameters, or the sender could have any state taken unchecked by choosing such parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.1)
    with pytest.raises(StateMismatch, match="a trial step of this Adam from the state turns its optimizer state "
                                            "'exp_avg_sq' of parameter 0 into NaN or Inf"):
        load_state(sent(lambda captured: captured.parameters[0].fill_(1e30)), list(model.parameters()), opt)
    assert not opt.state


@pytest.mark.parametrize("value, refused", [
    ("bar", "'foo' of parameter 0 is 'bar', not a tensor or a finite number"),
    (10**400, "'foo' of parameter 0 is 1000.*, not a tensor or a finite number"),
], ids=["a string", "an int beyond floats"])
def test_a_fresh_optimizer_refuses_optimizer_values_that_are_not_finite_numbers(value, refused):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(StateMismatch, match=refused):
        load_state(sent(changed("optimizer", "state", 0, "foo", value=value)), list(model.parameters()),
                   torch.optim.Adam(model.parameters()))


def test_a_loaded_state_keeps_this_trainers_hyperparameters_and_steps_to_finite_values():
    # every trainer sets its own learning rate for each step: a peer's (NaN, a string, 1e30) is never taken
    for lr in (float("nan"), "fast", 1e30):
        model, opt = adam(seed=0)
        load_state(sent(changed("optimizer", "param_groups", 0, "lr", value=lr)), list(model.parameters()), opt)
        assert opt.param_groups[0]["lr"] == 1e-3 and opt.state_dict()["state"][0]["step"] == 1
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_state_sending_one_value_both_as_a_tensor_and_a_scalar_is_malformed():
    model, opt = adam()
    messages = encode_state(TrainingState.capture(1, "0123abcd", 2, list(model.parameters()), opt), "run")
    extra = json.loads(messages[0].optimizer_json)
    extra["state"] = {"0": {"exp_avg": 1.0}}
    messages[0].optimizer_json = json.dumps(extra)
    with pytest.raises(StateDownloadError, match=r"\['exp_avg'\] of parameter 0 sent both as tensors and as"):
        decode_state(messages, 1 << 20)


def test_a_state_download_counts_every_field_and_every_message_against_its_caps():
    model, opt = adam()
    genuine = encode_state(TrainingState.capture(4, "0123abcd", 2, list(model.parameters()), opt), "run")
    served = {"messages": genuine}
    with StateServer(StateServicer("run", lambda: served["messages"])) as server:
        assert download_state(server.endpoint, "run", 10, *download_limits(list(model.parameters()))).step == 4
        # 2.5 MiB, no tensor (not in names: a name on anything but a tensor's header ends the download at once)
        served["messages"] = [dmoe_pb2.StatePart(optimizer_json="x" * (64 << 10)) for _ in range(40)]
        with pytest.raises(StateDownloadError, match="more than 1048576 bytes or 10000 messages"):
            download_state(server.endpoint, "run", timeout=10, max_bytes=1 << 20)
        served["messages"] = [dmoe_pb2.StatePart() for _ in range(1000)]  # empty: no bytes at all
        with pytest.raises(StateDownloadError, match="more than 1048576 bytes or 100 messages"):
            download_state(server.endpoint, "run", timeout=10, max_bytes=1 << 20, max_messages=100)

        # one message beyond the cap is refused by gRPC as it arrives: it was held whole (up to 64 MiB) first
        served["messages"] = [dmoe_pb2.StatePart(optimizer_json="x" * (3 << 20))]
        with pytest.raises(StateDownloadError, match="RESOURCE_EXHAUSTED") as refused:
            download_state(server.endpoint, "run", timeout=10, max_bytes=1 << 20)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_states_tensors_are_checked_on_their_headers_before_anything_of_theirs_is_decoded(monkeypatch):
    """A UINT8 tensor declared float64 decoded to 8 times its bytes on the wire (a 1 MiB model drew a 92 MiB peak
    from a download within its cap), and every tensor was decoded and copied before its shape was compared with the
    model's (review 87): compression is refused, and a header that does not fit the model ends the stream there."""
    from dmoe.wire.codec import UINT8, serialize

    import dmoe.collab.state_sync as state_sync

    model, opt = adam()
    parameters = list(model.parameters())
    genuine = encode_state(TrainingState.capture(4, "0123abcd", 2, parameters, opt), "run")
    squeezed = copy.deepcopy(genuine)
    squeezed[0].tensor.CopyFrom(serialize(parameters[0].detach().double(), UINT8))
    squeezed[0].tensor.parts = 1
    decoded: list[int] = []
    real_deserialize = state_sync.deserialize
    monkeypatch.setattr(state_sync, "deserialize", lambda t: decoded.append(1) or real_deserialize(t))
    with pytest.raises(StateDownloadError, match=r"malformed state: tensor 'param\.0' is compressed \(UINT8\)"):
        decode_state(squeezed, 1 << 20)  # refused even without the model to compare with
    assert not decoded
    big, big_opt = trained(hidden=8)  # parameter 0 is [8, 4] there, [3, 4] here
    other = encode_state(TrainingState.capture(4, "0123abcd", 2, list(big.parameters()), big_opt), "run")
    with pytest.raises(StateMismatch, match=r"parameter 0 has shape \[8, 4\] in the state, \[3, 4\] here"):
        decode_state(other, 1 << 20, parameters)
    wrong_moment = copy.deepcopy(genuine)
    (moment,) = [m for m in wrong_moment if m.name == "opt.0.exp_avg"]
    moment.tensor.CopyFrom(serialize(torch.zeros(3, 4, 64)))
    moment.tensor.parts = 1
    with pytest.raises(StateMismatch, match=r"optimizer state 'exp_avg' of parameter 0 has shape \[3, 4, 64\] in "
                                            r"the state, the parameter \[3, 4\] here"):
        decode_state(wrong_moment, 1 << 20, parameters)
    assert not decoded
    assert decode_state(genuine, 1 << 20, parameters).step == 4
    # over the wire: a state of another model is cut at its first header, not read to its end
    huge = torch.nn.Linear(4096, 4096)  # 64 MiB: 32 parts, far more than the stream's window
    far = encode_state(TrainingState.capture(4, "0123abcd", 2, list(huge.parameters()),
                                             torch.optim.SGD(huge.parameters(), lr=0.1)), "run")
    sent: list[int] = []

    class Counted(list):
        def __iter__(self):
            for index, message in enumerate(list.__iter__(self)):
                sent.append(index)
                yield message

    with StateServer(StateServicer("run", lambda: Counted(far))) as server:
        with pytest.raises(StateMismatch, match=r"parameter 0 has shape \[4096, 4096\] in the state, \[3, 4\] here"):
            download_state(server.endpoint, "run", 10, 1 << 30, parameters=parameters)
    assert len(sent) < len(far) // 2, (len(sent), len(far))  # not the whole state


class WithScale(torch.nn.Module):
    """A model with a 0-dimensional parameter, as a learned temperature or scale is."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def stepped_with_scale() -> tuple[WithScale, torch.optim.Optimizer]:
    """A :class:`WithScale` (seed 0) after one AdamW step: a state worth downloading."""
    torch.manual_seed(0)
    model = WithScale()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_zero_dimensional_parameter_has_a_lineage_and_its_state_survives_a_download():
    torch.manual_seed(0)
    model = WithScale()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    lineage = parameters_lineage(model.parameters())
    same = WithScale()
    same.load_state_dict(model.state_dict())
    assert parameters_lineage(same.parameters()) == lineage
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert parameters_lineage(model.parameters()) != lineage
    torch.manual_seed(1)
    fresh = WithScale()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    encoded = encode_state(TrainingState.capture(3, lineage, 1, list(model.parameters()), opt), "run")
    with StateServer(StateServicer("run", lambda: encoded)) as server:
        downloaded = download_state(server.endpoint, "run", 10, *download_limits(list(fresh.parameters())))
    load_state(downloaded, list(fresh.parameters()), fresh_opt)
    assert fresh.scale.shape == () and torch.equal(fresh.scale, model.scale)
    assert torch.equal(fresh_opt.state[fresh.scale]["exp_avg"], opt.state[model.scale]["exp_avg"])


def test_the_lineage_of_parameters_of_one_or_more_dimensions_did_not_change():
    import hashlib

    model, _ = trained(seed=3)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    parameters = [p.detach().to(dtype) for p, dtype in zip(model.parameters(), dtypes)]
    digest = hashlib.blake2b(digest_size=4)
    for p in parameters:  # as lineages were computed before 0-dimensional parameters were allowed
        digest.update(str(tuple(p.shape)).encode())
        digest.update(p.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    assert parameters_lineage(parameters) == digest.hexdigest()


# ---- the tracker on a real DHT ----
@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    with running("-m", "dmoe.dht", "--log-level", "WARNING") as proc:
        yield proc.endpoint()


def wait_until(condition, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return result


def test_trackers_see_each_others_progress_and_refuse_absurd_records(bootstrap, caplog):
    caplog.set_level(logging.WARNING, logger="dmoe.collab.progress")
    with DHT([bootstrap], client_mode=True) as dht_a, DHT([bootstrap], client_mode=True) as dht_b, \
            DHT([bootstrap], client_mode=True) as hostile:
        a = ProgressTracker(dht_a, "track", CONFIG, 11, progress(step=0, samples=0))
        b = ProgressTracker(dht_b, "track", CONFIG, 22, progress(step=0, samples=7))
        observer = ProgressTracker(dht_a, "track", CONFIG)
        try:
            expiration = time.time() + 30
            hostile.store(progress_key("track"), 33, progress(step=0, samples=10**9).encode(), expiration)
            hostile.store(progress_key("track"), 44, progress(step=0, stamp=time.time() + 3600).encode(), expiration)
            hostile.store(progress_key("track"), 55, "not;a;record", expiration)
            wait_until(lambda: 22 in a.state().peers and 11 in b.state().peers)
            wait_until(lambda: len(caplog.records) >= 9)  # three bad records, seen by each of the three trackers
            assert set(a.state().peers) == {22} and set(observer.state().peers) == {11, 22}
            assert a.state().samples_accumulated == 7
            b.update(samples=40)
            wait_until(lambda: a.state().peers[22].samples == 40)
            messages = "\n".join(r.getMessage() for r in caplog.records)
            assert "trainer 33: it claims 1000000000 samples toward step 0" in messages
            assert "trainer 44: it is stamped 3600 s in the future" in messages
            assert "trainer 55: it is malformed: 'not;a;record' (3 fields instead of 8)" in messages
            time.sleep(0.5)
            assert len(caplog.records) == 9  # each refusal is logged once per tracker, not once per read
            a.ban(22, "a test")
            assert 22 not in a.refresh_now()
        finally:
            b.close()  # marks itself gone: the others stop counting it at once
            wait_until(lambda: 22 not in observer.refresh_now())
            a.close()
            observer.close()


def test_the_averagers_group_size_must_allow_a_group(bootstrap):
    from dmoe import DecentralizedAverager

    with DHT([bootstrap], client_mode=True) as dht, DecentralizedAverager([torch.zeros(3)], dht, "gs") as averager:
        with pytest.raises(ValueError, match="group_size 1 is below min_group_size 2"):
            averager.step(group_size=1)


def test_a_config_refuses_settings_that_cannot_work():
    with pytest.raises(ValueError, match="target_batch_size"):
        CollaborationConfig(target_batch_size=0)
    with pytest.raises(ValueError, match="two refresh periods"):
        CollaborationConfig(target_batch_size=8, refresh_period=5.0, progress_ttl=6.0)
    for share in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="failed_download_share"):
            CollaborationConfig(target_batch_size=8, failed_download_share=share)
    with pytest.raises(ValueError, match="run_id"):
        progress_key("my run")
    assert GONE != ACCUMULATING != AVERAGING


def test_a_peer_too_late_for_a_single_group_gives_up_at_once_instead_of_waiting_out_matchmaking(bootstrap):
    from dmoe import DecentralizedAverager

    with DHT([bootstrap], client_mode=True) as first, DHT([bootstrap], client_mode=True) as second, \
            DHT([bootstrap], client_mode=True) as third:
        dhts = [first, second, third]
        averagers = [DecentralizedAverager([torch.full((3,), float(i))], dht, "late", matchmaking_time=8)
                     for i, dht in enumerate(dhts)]
        keys = [dht.identity.public_key for dht in dhts]
        try:
            early = [a.step(weight=1.0, group_size=2, single_group=True, wait=False, expected_peers={keys[1 - i]})
                     for i, a in enumerate(averagers[:2])]
            infos = [future.result(60) for future in early]
            assert all(info is not None and len(info.contributors) == 2 for info in infos)
            started = time.monotonic()
            # the late one expects the two others (their DHT keys: a collaboration takes them from their records)
            assert averagers[2].step(weight=1.0, group_size=3, single_group=True, expected_peers=keys[:2]) is None
            # not the 8 s of matchmaking (with room for a loaded machine): the round's group formed without it
            assert time.monotonic() - started < 7
            assert averagers[2].tensors[0].tolist() == [2.0, 2.0, 2.0]
        finally:
            for averager in averagers:
                averager.shutdown()


def test_records_stored_ahead_under_the_keys_of_steps_to_come_keep_no_trainer_from_averaging(bootstrap):
    """The averaging key of a global step is predictable (``<run>.grad.<step>.*``), and anyone can store there ahead
    of time: a "group" of ids of its own key made every trainer give up averaging as too late, and a waiting peer
    of a smaller id than everyone's, which never leads, held every trainer up until its averaging timed out. A
    trainer's averaging now reads only the declarations of its partners (the DHT keys that signed their progress
    records), so each step averages the two trainers' samples."""
    from dmoe.averaging.matchmaking import MAX_PEER_ID, key_text, new_salt, peer_id_for

    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    with DHT([bootstrap], client_mode=True) as hostile, DHT([bootstrap], client_mode=True) as first, \
            DHT([bootstrap], client_mode=True) as second:
        expiration, nonce = time.time() + 600, "deadbeef"
        for step in range(4):
            key = f"ahead.grad.{step}.*"
            salts = [new_salt() for _ in range(2)]
            ids = [peer_id_for(hostile.identity.public_key, key, salt) for salt in salts]
            member = f"127.0.0.1:9;1;{key_text(hostile.identity.public_key)}"  # a group entry names the member's key
            hostile.store_many({f"{key}.{ids[0]}.{nonce}": {pid: (member, expiration) for pid in ids}})
            entries = {pid: (f"127.0.0.1:9;1;{salt};{state}", expiration)
                       for pid, salt, state in zip(ids, salts, [f"L2.{nonce}", "w"])}
            while True:  # a salt that makes an id smaller than any trainer's but for 1 in ~10**4
                salt = new_salt()
                smallest = peer_id_for(hostile.identity.public_key, key, salt)
                if smallest < MAX_PEER_ID // 10_000:
                    break
            entries[smallest] = (f"127.0.0.1:9;1;{salt};w", expiration)
            assert all(result is True for result in hostile.store_many({key: entries})[key].values())
        collabs = [CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "ahead", 8,
                                          matchmaking_time=2.0, allreduce_timeout=5.0, refresh_period=0.2,
                                          progress_ttl=2.0) for model, dht in zip(models, (first, second))]
        try:
            assert all(collab.wait_for_trainers(2, 20) == 2 for collab in collabs)

            def train(index: int) -> None:
                while collabs[index].local_step < 3:
                    models[index](torch.randn(4, 4)).sum().backward()
                    collabs[index].step(4)
                    collabs[index].zero_grad()
                    time.sleep(0.05)

            threads = [threading.Thread(target=train, args=(index,), daemon=True) for index in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert not any(thread.is_alive() for thread in threads)
            for collab in collabs:  # every step averaged by both: none alone, no download
                assert (collab.local_step, collab.steps_applied, collab.steps_downloaded, collab.group_size) == (
                    3, 3, 0, 2)
            assert collabs[0].lineage == collabs[1].lineage
            assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
        finally:
            for collab in collabs:
                collab.shutdown()


def test_trainers_whose_last_averaging_failed_end_on_one_model(bootstrap, monkeypatch):
    """Both trainers' last averaging fails and neither sees the other ahead: each steps alone, onto a lineage of
    its own, and no later step re-syncs them. finish() compared steps only and said True, and each trainer saved
    another model (review 60). Now the one off the canonical lineage downloads it in finish()."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    failing = threading.Barrier(2)

    def fail_together(*args, **kwargs) -> None:  # both reach the step, and neither's averaging succeeds
        failing.wait(30)

    monkeypatch.setattr(CollaborativeOptimizer, "_wait_for_others", lambda self, step: False)
    with DHT([bootstrap], client_mode=True) as first, DHT([bootstrap], client_mode=True) as second:
        collabs = [CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "split", 8,
                                          refresh_period=0.2, progress_ttl=5.0, finish_timeout=20.0)
                   for model, dht in zip(models, (first, second))]
        try:
            assert all(collab.wait_for_trainers(2, 20) == 2 for collab in collabs)
            for collab in collabs:
                monkeypatch.setattr(collab.averager, "step", fail_together)

            def train(index: int) -> None:
                torch.manual_seed(index)
                while collabs[index].local_step < 1:
                    models[index](torch.randn(4, 4)).sum().backward()
                    collabs[index].step(4)
                    collabs[index].zero_grad()
                    time.sleep(0.05)

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                list(pool.map(train, range(2), timeout=60))
                assert [(c.local_step, c.steps_applied, c.group_size) for c in collabs] == [(1, 1, 1)] * 2
                assert collabs[0].lineage != collabs[1].lineage  # split, as the failure leaves them
                finished = list(pool.map(lambda collab: collab.finish(), collabs, timeout=60))
            assert finished == [True, True]
            assert collabs[0].lineage == collabs[1].lineage and sum(c.steps_downloaded for c in collabs) == 1
            assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
        finally:
            for collab in collabs:
                collab.shutdown()


def test_a_progress_record_no_node_would_take_is_refused_at_the_start_or_logged_and_the_tracker_goes_on(
        bootstrap, caplog, monkeypatch):
    caplog.set_level(logging.ERROR, logger="dmoe.collab.progress")
    full_ipv6 = "[2a02:8071:5e80:1a40:d1c3:9a2b:7f10:4e1d]:43123"
    with DHT([bootstrap], client_mode=True) as dht_a, DHT([bootstrap], client_mode=True) as dht_b:
        with pytest.raises(ValueError, match="cannot carry its state endpoint .*--averaging-host"):
            ProgressTracker(dht_a, "fit", CONFIG, 11, progress(step=0, samples=0, endpoint=full_ipv6))
        a = ProgressTracker(dht_a, "fit", CONFIG, 11, progress(step=0, samples=0))
        observer = ProgressTracker(dht_b, "fit", CONFIG)
        try:
            a.update(step=10**90)  # a record too long for any node: refused by the DHT before it is sent
            assert a.publish_now() is False
            assert "could not publish progress" in caplog.text
            a.update(step=4)  # the tracker's thread is still there to publish it
            wait_until(lambda: observer.refresh_now().get(11) is not None and observer.state().peers[11].step == 4)
            def unreadable(key: str):
                raise OSError("an error nobody foresaw")

            monkeypatch.setattr(dht_a, "get", unreadable)
            wait_until(lambda: "the progress tracker's refresh failed" in caplog.text)
            a.update(step=5)  # nor does that stop it
            wait_until(lambda: observer.refresh_now().get(11) is not None and observer.state().peers[11].step == 5)
        finally:
            a.close()
            observer.close()


def test_a_trainer_whose_clock_is_behind_counts_until_it_goes_silent_and_a_long_silent_record_is_refused(
        bootstrap, caplog):
    """Liveness is judged on the reader's clock, by when it first read a record's stamp: by the writer's own stamp,
    a trainer whose clock is behind by more than progress_ttl was dropped by everyone, without a word."""
    caplog.set_level(logging.WARNING, logger="dmoe.collab.progress")
    with DHT([bootstrap], client_mode=True) as dht, DHT([bootstrap], client_mode=True) as behind:
        reader = ProgressTracker(dht, "skew", CONFIG, 11, progress(step=0, samples=0))
        try:
            now = time.time()
            key = progress_key("skew")
            behind.store(key, 22, progress(step=0, samples=8, stamp=now - 15).encode(), now + 60)  # 15 s slow
            behind.store(key, 33, progress(step=0, stamp=now - 3600).encode(), now + 60)  # silent for an hour
            seen = wait_until(lambda: reader.refresh_now().get(22))
            assert seen.samples == 8 and reader.state().samples_accumulated == 8
            assert abs(seen.time - time.time()) < 5  # extrapolated from when it was read here, not 15 s back
            assert 33 not in reader.state().peers
            assert "trainer 33: it is stamped 3600 s in the past" in caplog.text
            behind.store(key, 22, progress(step=0, samples=12, stamp=time.time() - 15).encode(), time.time() + 60)
            wait_until(lambda: (reader.refresh_now().get(22) or progress(samples=0)).samples == 12)
            # then silent (its entry outlives it): dropped once its stamp is progress_ttl old here
            wait_until(lambda: 22 not in reader.refresh_now(), timeout=CONFIG.progress_ttl + 10)
            assert "trainer 22" not in caplog.text
        finally:
            reader.close()


def test_a_trainer_that_no_node_lets_publish_says_so(bootstrap, caplog):
    """Anyone can fill a run's progress record (256 entries): a trainer then joining is invisible to the others,
    which neither count it nor wait for it; it must at least say so."""
    caplog.set_level(logging.WARNING, logger="dmoe.collab.progress")
    with DHT([bootstrap], client_mode=True) as dht, DHT([bootstrap], client_mode=True) as hostile:
        expiration = time.time() + 120
        junk = progress(step=0).encode()
        hostile.store_many({progress_key("full"): {1000 + i: (junk, expiration)
                                                   for i in range(dht.config.max_record_subkeys)}})
        tracker = ProgressTracker(dht, "full", CONFIG, 11, progress(step=0, samples=0))
        try:
            wait_until(lambda: "publishes of this trainer's progress in a row were taken by no DHT node" in
                       caplog.text)
        finally:
            tracker.close()


def test_a_trainer_waits_for_the_partners_still_finishing_the_last_step_before_it_takes_the_next(bootstrap):
    """A trainer that reaches the target before its partners of the last step published this step (their
    all-reduce ends later than its own) stepped alone: it put them a lineage behind, to download its state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with DHT([bootstrap], client_mode=True) as dht, DHT([bootstrap], client_mode=True) as partner, \
            CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "finishing", 8,
                                   refresh_period=0.2, progress_ttl=30.0, allreduce_timeout=8.0,
                                   client_mode=True) as collab:
        first = collab.lineage
        model(torch.randn(8, 3)).sum().backward()
        assert collab.step(8) and collab.local_step == 1  # alone: nobody else
        collab._left_partners = frozenset({partner.identity.public_key})  # as if that step's group had expected it
        key = progress_key("finishing")
        partner.store(key, 77, Progress(0, 8, 10.0, time.time(), None, AVERAGING, first, 0).encode(),
                      time.time() + 60)
        wait_until(lambda: 77 in collab.tracker.refresh_now())

        def finish() -> None:
            time.sleep(1.0)
            partner.store(key, 77, Progress(1, 0, 10.0, time.time(), None, ACCUMULATING, collab.lineage, 1).encode(),
                          time.time() + 60)

        thread = threading.Thread(target=finish)
        thread.start()
        started = time.monotonic()
        state = collab._await_finishing(collab.tracker.state())
        waited = time.monotonic() - started
        thread.join()
        assert 0.8 < waited < 7.0, waited
        assert set(state.partners) == {77}


def test_only_the_partners_of_the_last_step_are_waited_for_and_only_until_they_moved_on(bootstrap):
    """The wait for partners still finishing the last step took any record at the step before, averaging, on the
    lineage left: both public, so one forged record that was nobody's partner held every trainer for the
    all-reduce timeout at every step, and made finish() fail (review 87). Only the keys seen at the step on its
    lineage while this trainer was there count now, each until a record it signed is at the new step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with DHT([bootstrap], client_mode=True) as dht, DHT([bootstrap], client_mode=True) as partner, \
            DHT([bootstrap], client_mode=True) as hostile, \
            CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "forged-finish", 8,
                                   refresh_period=0.2, progress_ttl=30.0, allreduce_timeout=6.0,
                                   client_mode=True) as collab:
        first = collab.lineage
        model(torch.randn(8, 3)).sum().backward()
        assert collab.step(8) and collab.local_step == 1
        collab._left_partners = frozenset({partner.identity.public_key})  # as if that step's group had expected it
        key = progress_key("forged-finish")
        now = time.time()
        hostile.store(key, 66, Progress(0, 0, 0.0, now, None, AVERAGING, first, 1).encode(), now + 60)
        wait_until(lambda: 66 in collab.tracker.refresh_now())
        started = time.monotonic()
        collab._await_finishing(collab.tracker.state())
        assert time.monotonic() - started < 1.0  # anyone's record: not waited for
        # a partner's key with a record still averaging the last step and one at this step: it moved on
        partner.store_many({key: {77: (Progress(0, 8, 10.0, now, None, AVERAGING, first, 0).encode(), now + 60),
                                  78: (Progress(1, 0, 10.0, now, None, ACCUMULATING, collab.lineage, 1).encode(),
                                       now + 60)}})
        wait_until(lambda: {77, 78} <= set(collab.tracker.refresh_now()))
        started = time.monotonic()
        state = collab._await_finishing(collab.tracker.state())
        assert time.monotonic() - started < 1.0
        assert 78 in state.partners
        # alone at its last step: nobody's record is waited for
        collab._left_partners = frozenset()
        partner.store(key, 78, Progress(0, 8, 10.0, now, None, AVERAGING, first, 0).encode(), now + 61)
        wait_until(lambda: collab.tracker.refresh_now()[78].step == 0)
        started = time.monotonic()
        collab._await_finishing(collab.tracker.state())
        assert time.monotonic() - started < 1.0
        # who is waited for after a step: the keys of records read at its step and lineage while this trainer was
        # there (partners, and one that joined too late for the group), not those read at the step before
        hostile.store(key, 67, Progress(1, 0, 0.0, now, None, ACCUMULATING, collab.lineage, 1).encode(), now + 60)
        wait_until(lambda: 67 in collab.tracker.refresh_now())
        assert collab.tracker.companions() == {partner.identity.public_key, hostile.identity.public_key}
        collab.tracker.update(step=2, lineage="0000aaaa")
        assert collab.tracker.companions() == frozenset()


def test_a_wait_for_reports_that_the_speeds_promised_in_vain_is_not_repeated_at_the_step(bootstrap):
    """A record claiming an absurd speed (or a partner that paused) makes the estimate say the target is reached
    while no report says so: each batch waited up to two batch times for reports that never came."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with DHT([bootstrap], client_mode=True) as dht, DHT([bootstrap], client_mode=True) as hostile, \
            CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "vain", 1000,
                                   refresh_period=0.2, progress_ttl=30.0, client_mode=True) as collab:
        hostile.store(progress_key("vain"), 66, Progress(0, 0, 1e30, time.time(), None, ACCUMULATING, collab.lineage,
                                                         0).encode(), time.time() + 60)
        wait_until(lambda: 66 in collab.tracker.refresh_now())
        waits = []
        real_wait = collab._wait_for_reports
        collab._wait_for_reports = lambda batch_size: waits.append(batch_size) or real_wait(batch_size)
        for _ in range(6):
            model(torch.randn(4, 3)).sum().backward()
            collab.step(4)
            time.sleep(0.02)
        assert len(waits) == 1 and collab.local_step == 0


def test_records_pointing_at_an_address_that_never_answers_cost_one_connection_timeout_not_one_per_record(
        bootstrap, caplog):
    """Records are free: many peer ids claiming a step ahead at an endpoint that accepts TCP and never speaks each
    held the training loop for the whole state timeout (60 s by default), one after another."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    try:
        with DHT([bootstrap], client_mode=True) as hostile, DHT([bootstrap], client_mode=True) as dht:
            now = time.time()
            hostile.store_many({progress_key("silent"): {pid: (Progress(10, 0, 1.0, now, endpoint, ACCUMULATING,
                                                                        "0123abcd", 3).encode(), now + 60)
                                                         for pid in range(901, 906)}})
            started = time.monotonic()
            with CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "silent", 8,
                                        refresh_period=0.2, progress_ttl=30.0, state_timeout=30.0,
                                        client_mode=True) as collab:
                collab.wait_for_trainers(count=10, timeout=2.0)  # tries to sync all the while
                assert collab.local_step == 0
            elapsed = time.monotonic() - started
    finally:
        silent.close()
    refused = re.findall(r"ignoring trainer (90\d) .*no connection within 5s", caplog.text)
    assert len(refused) == 1, caplog.text  # one try: the endpoint is banned, not only the peer id
    assert f"no state downloads from {endpoint} for 60 s" in caplog.text
    assert elapsed < 20, elapsed  # one 5 s connection timeout (and start-up), not 5 x 30 s


class SlowServicer(StateServicer):
    """A hostile state server: each download waits ``delay`` seconds (within the downloader's state_timeout), then
    fails with INTERNAL (``fail``) or serves its state."""

    def __init__(self, *args, delay: float, fail: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay, self.fail = delay, fail

    async def download_state(self, request, context):
        await asyncio.sleep(self.delay)
        if self.fail:
            await context.abort(grpc.StatusCode.INTERNAL, "oops")
        await super().download_state(request, context)


def test_a_state_server_that_fails_slowly_is_banned_by_machine_whatever_the_error_and_peer_ids(bootstrap, caplog):
    """Only UNAVAILABLE and DEADLINE_EXCEEDED banned a state server's machine: one that failed every download with
    another status (or a state off the claim) just before state_timeout, named by records under ever new peer ids
    (free to make), held every step() for about state_timeout, for good (review 87). Now any failure it is
    responsible for bans its machine, and so does a refusal that may not be its fault (another step or lineage than
    a record claimed) once it took long; such a refusal that came at once bans that record only, and the honest
    trainer it named stays a source."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    ahead, ahead_opt = stepped_with_scale()
    capture = lambda step, lineage: encode_state(  # noqa: E731
        TrainingState.capture(step, lineage, 3, list(ahead.parameters()), ahead_opt), "slow")
    elsewhere, honest_state = capture(10, "deadbeef"), capture(7, "0123abcd")
    with DHT([bootstrap], client_mode=True) as hostile, \
            StateServer(SlowServicer("slow", lambda: None, delay=2.5, fail=True)) as failing, \
            StateServer(SlowServicer("slow", lambda: elsewhere, delay=2.5, fail=False)) as off_claim, \
            StateServer(StateServicer("slow", lambda: honest_state)) as honest:
        now = time.time()
        records = {pid: Progress(10, 0, 1.0, now, failing.endpoint, ACCUMULATING, "0123abcd", 3)
                   for pid in (911, 912, 913)}
        records.update({pid: Progress(10, 0, 1.0, now, off_claim.endpoint, ACCUMULATING, "0123abcd", 3)
                        for pid in (921, 922, 923)})
        records[931] = Progress(8, 0, 1.0, now, honest.endpoint, ACCUMULATING, "0123abcd", 3)  # not what it holds
        records[932] = Progress(7, 0, 1.0, now, honest.endpoint, ACCUMULATING, "0123abcd", 3)  # its own
        hostile.store_many({progress_key("slow"): {pid: (p.encode(), now + 60) for pid, p in records.items()}})
        torch.manual_seed(1)
        joiner = WithScale()
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.AdamW(joiner.parameters(), lr=0.01), dht, "slow", 100, refresh_period=0.2,
                progress_ttl=30.0, state_timeout=6.0, client_mode=True,
                failed_download_share=1.0) as collab:  # (no limit on the time of failed downloads: one try each)
            wait_until(lambda: collab.wait_for_trainers(count=20, timeout=0.2) and collab.local_step == 7)
            assert (collab.lineage, collab.steps_downloaded) == ("0123abcd", 1)
    text = caplog.text
    # one try each (the records under its other ids then serve nothing), not one per peer id
    assert len(re.findall(r"ignoring trainer 91\d .*INTERNAL: oops", text)) == 1, text
    assert len(re.findall(r"ignoring trainer 92\d .*claims lineage 0123abcd at step 10 but serves deadbeef",
                          text)) == 1, text
    assert f"no state downloads from {failing.endpoint} for 60 s" in text
    assert re.search(rf"no state downloads from {re.escape(off_claim.endpoint)} for 60 s \(its download took "
                     rf"2\.\ds to come to nothing\)", text), text
    assert re.search(r"ignoring trainer 931 .*claims step 8 but serves step 7", text), text
    assert f"no state downloads from {honest.endpoint}" not in text  # it answered what it holds, at once
    assert "downloaded the state at step 7 from trainer 932" in text


def test_every_spelling_and_name_of_one_failing_state_server_is_one_machine(bootstrap, caplog, monkeypatch):
    """A host name was a machine of its own in every spelling (``localhost``, ``Localhost``: DNS ignores case) and
    every name of a wildcard domain another, so records naming one failing server anew each held every step() for
    its delay, up to state_timeout each (review 107 D1). A name is resolved before its download now, and the
    address dialed is the one banned."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kwargs: real(  # a wildcard domain of its own
        "127.0.0.1" if str(host).lower().endswith(".evil.example") else host, *args, **kwargs))
    with DHT([bootstrap], client_mode=True) as hostile, \
            StateServer(SlowServicer("names", lambda: None, delay=0.3, fail=True)) as failing:
        port = failing.endpoint.rpartition(":")[2]
        names = ["localhost", "Localhost", "LOCALHOST", "a1.evil.example", "A2.evil.example", "a3.EVIL.example"]
        now = time.time()
        hostile.store_many({progress_key("names"): {961 + i: (Progress(
            10, 0, 1.0, now, f"{name}:{port}", ACCUMULATING, "0123abcd", 3).encode(), now + 60)
            for i, name in enumerate(names)}})
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), dht, "names", 100, refresh_period=0.2,
                progress_ttl=30.0, client_mode=True) as collab:
            # one record tried and banned, every other one seen to name the same machine, without a try
            wait_until(lambda: collab.wait_for_trainers(count=10, timeout=0.2)
                       and len(collab.collaboration.peers) == len(names) - 1
                       and all(p.endpoint is None for p in collab.collaboration.peers.values()))
            assert collab.local_step == 0
    assert len(re.findall(r"ignoring trainer 96\d .*INTERNAL: oops", caplog.text)) == 1, caplog.text
    assert re.search(rf"no state downloads from a\d\.evil\.example:{port} for 60 s \(it is 127\.0\.0\.1:{port}, "
                     rf"banned\)", caplog.text, re.IGNORECASE), caplog.text


def test_downloads_that_come_to_nothing_take_a_bounded_share_of_the_training_loop_whatever_their_sources(
        bootstrap, caplog):
    """Records are free to write and may name any address (one that drops packets, a new port of loopback, a new
    name): each failing source, banned after its failure, was followed by the next one at the next step(), and one
    peer held every trainer's step() for a connection timeout (or up to state_timeout) per batch, without end
    (review 107 D1). They take at most a tenth of the trainer's time now (failed_download_share), after the first
    state_timeout / 4 of them."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    servers = [StateServer(SlowServicer("share", lambda: None, delay=0.45, fail=True)) for _ in range(8)]
    try:
        with DHT([bootstrap], client_mode=True) as hostile, DHT([bootstrap], client_mode=True) as dht:
            now = time.time()
            hostile.store_many({progress_key("share"): {971 + i: (Progress(
                10, 0, 1.0, now, server.endpoint, ACCUMULATING, "0123abcd", 3).encode(), now + 60)
                for i, server in enumerate(servers)}})  # each port of loopback a machine of its own
            model = torch.nn.Linear(3, 2)
            with CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "share", 10**6,
                                        refresh_period=0.2, progress_ttl=30.0, state_timeout=2.0,
                                        client_mode=True) as collab:
                started, in_step = time.monotonic(), 0.0  # (the constructor tried one of them)
                while time.monotonic() - started < 3.0:  # batches of 0.1 s
                    time.sleep(0.1)
                    model(torch.randn(4, 3)).sum().backward()
                    before = time.monotonic()
                    collab.step(4)
                    in_step += time.monotonic() - before
                    collab.zero_grad()
    finally:
        for server in servers:
            server.close()
    failed = re.findall(r"ignoring trainer 97\d .*INTERNAL: oops", caplog.text)
    # 0.5 s of failures allowed at first (state_timeout / 4), spent by the constructor's and the first step()'s,
    # then 0.1 s a second: none for 4 s
    assert len(failed) <= 3, caplog.text
    assert in_step < 1.0, in_step


def test_a_download_that_failed_slowly_pauses_the_next_for_a_share_of_slow_refusal_not_of_its_whole_time(bootstrap):
    """A slow failure bans its server's machine, so it is charged at most slow_refusal: charged in full, one honest
    trainer dying during a 60 s download kept a joiner from trying anyone else for nine minutes."""
    with DHT([bootstrap], client_mode=True) as dht:
        model = torch.nn.Linear(3, 2)
        with CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "slowfail", 10**6,
                                    refresh_period=0.2, progress_ttl=30.0, state_timeout=2.0,
                                    client_mode=True) as collab:
            record = Progress(10, 0, 1.0, time.time(), "127.0.0.1:1", ACCUMULATING, "0123abcd", 3)

            class Ahead:
                def source(self, rng=None):
                    return 977, record

            collab.tracker.state = Ahead
            collab._download = lambda *args: time.sleep(0.8) or False  # slower than slow_refusal (0.5 s)
            assert collab._may_download()
            assert not collab._sync_if_needed()
            assert collab._may_download(), collab._download_budget  # (charged 0.8 s, it waited 3 s)


class Leapfrog(StateServicer):
    """A hostile state server whose every download, after ``delay`` (within slow_refusal), refuses in a way that may
    be no fault of its own: a head two steps past its record, which it raises by one meanwhile to explain it
    ("stepped on since its record was read"), or (``off_claim``) a head of another lineage than its record claims,
    published under a fresh peer id each time."""

    def __init__(self, *args, dht: DHT, delay: float, off_claim: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.dht, self.delay, self.off_claim = dht, delay, off_claim
        self.claim, self.peer_id, self.endpoint, self.downloads = 10, 981, "", 0

    def publish(self) -> None:
        now = time.time()
        self.dht.store(progress_key(self.run_id), self.peer_id, Progress(
            self.claim, 0, 1.0, now, self.endpoint, ACCUMULATING, "0123abcd", 3).encode(), now + 60)

    async def download_state(self, request, context):
        self.downloads += 1
        served = self.claim if self.off_claim else self.claim + 2
        if self.off_claim:
            self.peer_id += 1
        else:
            self.claim += 1
        await asyncio.get_running_loop().run_in_executor(None, self.publish)
        await asyncio.sleep(self.delay)
        await context.write(dmoe_pb2.StatePart(run_id=self.run_id, step=served,
                                               lineage="deadbeef" if self.off_claim else "0123abcd"))
        await asyncio.sleep(10)  # the trainer cancels after the head


@pytest.mark.parametrize("off_claim", [False, True], ids=["stepped on", "off claim"])
def test_a_state_server_refusing_just_within_slow_refusal_again_and_again_is_banned(bootstrap, caplog, off_claim):
    """A refusal that may be no fault of the server (a state two steps past a record raised one step meanwhile, or
    off a claim made under a fresh peer id) banned nothing when it came within slow_refusal, and one such server
    held every step() for that long, forever (review 107 D2). Its machine is banned at its second one in a row."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    run = "off-claim" if off_claim else "stepped-on"
    with DHT([bootstrap], client_mode=True) as hostile:
        servicer = Leapfrog(run, lambda: None, dht=hostile, delay=0.3, off_claim=off_claim)
        with StateServer(servicer) as server:
            servicer.endpoint = server.endpoint
            servicer.publish()
            model = torch.nn.Linear(3, 2)
            with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1), dht, run, 10**6, refresh_period=0.2,
                    progress_ttl=30.0, client_mode=True) as collab:
                wait_until(lambda: collab.wait_for_trainers(count=10, timeout=0.2)
                           and f"no state downloads from {server.endpoint}" in caplog.text)
                for _ in range(10):
                    model(torch.randn(4, 3)).sum().backward()
                    collab.step(4)
                    time.sleep(0.05)
                assert collab.local_step == 0
        assert servicer.downloads == 2, caplog.text
    assert f"no state downloads from {server.endpoint} for 60 s (2 downloads from its machine in a row came to " \
           f"nothing)" in caplog.text


def test_a_trainer_busy_again_and_again_that_refuses_at_once_is_not_banned(bootstrap, caplog):
    """A busy trainer (RESOURCE_EXHAUSTED: its most downloads at once) refuses on arrival; a wave of joiners may find
    it busy again and again, and the count of refusals in a row (review 107 D2) must not ban it for them."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    servicer = StateServicer("busy", lambda: None)
    servicer.max_downloads = 0  # every place taken
    with DHT([bootstrap], client_mode=True) as hostile, StateServer(servicer) as busy:
        now = time.time()
        hostile.store_many({progress_key("busy"): {pid: (Progress(
            10, 0, 1.0, now, busy.endpoint, ACCUMULATING, "0123abcd", 3).encode(), now + 60) for pid in (991, 992, 993)}})
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), dht, "busy", 100, refresh_period=0.2,
                progress_ttl=30.0, client_mode=True) as collab:
            wait_until(lambda: collab.wait_for_trainers(count=10, timeout=0.2)
                       and all(f"ignoring trainer {pid} for 5 s" in caplog.text for pid in (991, 992, 993)))
            assert not collab.tracker.endpoint_banned(busy.endpoint)
    assert f"no state downloads from {busy.endpoint}" not in caplog.text


def test_records_naming_an_honest_state_server_with_a_step_it_does_not_serve_do_not_get_it_banned(bootstrap, caplog):
    """Records are free to write under any peer id: two naming an honest trainer's endpoint one step above what it
    serves were tried first (the highest step), each refusal a strike against its machine, and the second banned
    it (then twice as long, and so on): a joiner had no source left (review 114 D2). What it served is what its own
    record claims, so the lie is the other records': they are banned, and the state is downloaded through its own."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    ahead, ahead_opt = stepped_with_scale()
    state = encode_state(TrainingState.capture(7, "0123abcd", 3, list(ahead.parameters()), ahead_opt), "framed")
    with DHT([bootstrap], client_mode=True) as hostile, DHT([bootstrap], client_mode=True) as own, \
            StateServer(StateServicer("framed", lambda: state)) as honest:
        now = time.time()
        own.store(progress_key("framed"), 902, Progress(7, 0, 1.0, now, honest.endpoint, ACCUMULATING, "0123abcd",
                                                        3).encode(), now + 60)
        hostile.store_many({progress_key("framed"): {pid: (Progress(
            8, 0, 1.0, now, honest.endpoint, ACCUMULATING, "ffffffff", 3).encode(), now + 60) for pid in (911, 912)}})
        torch.manual_seed(1)
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.AdamW(WithScale().parameters(), lr=0.01), dht, "framed", 100, refresh_period=0.2,
                progress_ttl=30.0, client_mode=True) as collab:
            wait_until(lambda: collab.wait_for_trainers(count=10, timeout=0.2) and collab.local_step == 7
                       and all(f"ignoring trainer {pid} for 60 s" in caplog.text for pid in (911, 912)))
            assert (collab.lineage, collab.steps_downloaded) == ("0123abcd", 1)
            assert not collab.tracker.endpoint_banned(honest.endpoint)
            assert collab.collaboration.peers[902].endpoint == honest.endpoint
    assert f"no state downloads from {honest.endpoint}" not in caplog.text
    assert "downloaded the state at step 7 from trainer 902" in caplog.text


class Alternating(StateServicer):
    """A hostile state server whose every head, at once, is off the claim of the record it was asked for and what
    another record naming it claims: lineage ``deadbeef`` and ``0123abcd`` by turns, at step 10."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.downloads = 0

    async def download_state(self, request, context):
        self.downloads += 1
        await context.write(dmoe_pb2.StatePart(run_id=self.run_id, step=10,
                                               lineage="deadbeef" if self.downloads % 2 else "0123abcd"))
        await asyncio.sleep(10)  # the trainer cancels after the head


def test_a_state_server_whose_refusals_other_records_back_is_still_banned(bootstrap, caplog):
    """A refusal backed by another record naming the same server strikes nothing (review 114 D2), but the state is
    then downloaded through that record, and a refusal there counts: records under fresh ids backing each refusal
    would otherwise have kept review 107 D2's server refusing every step() for free."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    servicer = Alternating("backed", lambda: None)
    with DHT([bootstrap], client_mode=True) as hostile, StateServer(servicer) as server:
        now = time.time()
        records = {981: "0123abcd", 982: "0123abcd", 983: "deadbeef"}  # 0123abcd the canonical lineage: tried first
        hostile.store_many({progress_key("backed"): {pid: (Progress(
            10, 0, 1.0, now, server.endpoint, ACCUMULATING, lineage, 3).encode(), now + 60)
            for pid, lineage in records.items()}})
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), dht, "backed", 100,
                refresh_period=0.2, progress_ttl=30.0, client_mode=True, failed_download_share=1.0) as collab:
            wait_until(lambda: collab.wait_for_trainers(count=10, timeout=0.2)
                       and collab.tracker.endpoint_banned(server.endpoint))
            assert collab.local_step == 0
        assert servicer.downloads == 3, caplog.text  # one excused and downloaded through 983, refused, then one more
    assert re.search(r"is what trainer 983 claims \(step 10, lineage deadbeef\): the lie was trainer 98[12]'s",
                     caplog.text), caplog.text
    assert f"no state downloads from {server.endpoint} for 60 s (2 downloads from its machine in a row came to " \
           f"nothing)" in caplog.text


@contextlib.contextmanager
def pinning_swarm(bootstrap, run_id: str, records: Callable[[str], dict[int, Progress]], state: Callable[[], bytes]):
    """A state server serving ``state()`` and a thread writing ``records(its endpoint)`` afresh every 0.3 s (each
    call may name new peer ids); yields the server's endpoint and how many downloads it served."""
    class Counting(StateServicer):
        downloads = 0

        async def download_state(self, request, context):
            type(self).downloads += 1
            await super().download_state(request, context)

    stop = threading.Event()
    with DHT([bootstrap], client_mode=True) as writer_dht, StateServer(Counting(run_id, state)) as server:
        def write() -> None:
            while not stop.is_set():
                now = time.time()
                writer_dht.store_many({progress_key(run_id): {
                    pid: (progress.encode(), now + 60) for pid, progress in records(server.endpoint).items()}})
                stop.wait(0.3)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            yield server.endpoint, Counting
        finally:
            stop.set()
            writer.join()


def test_a_server_backed_by_its_own_record_is_not_dialed_for_throwaway_records_claiming_more_of_it(bootstrap, caplog,
                                                                                                  monkeypatch):
    """A hostile server keeps a record of its own claiming what it serves (step 0) and writes fresh records under
    throwaway ids claiming step 10 at its endpoint: each was tried first, refused, excused by its own record and,
    nothing there being ahead, neither struck nor downloaded through, so a joiner dialed it for every fresh record,
    for ever (review 116 D1). Records claiming more of it are now passed over undialed for PIN_SECONDS."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    monkeypatch.setattr(collab_optimizer, "PIN_SECONDS", 60.0)  # (the whole test within one pin)
    model = torch.nn.Linear(3, 2)
    state = encode_state(TrainingState.capture(0, "0123abcd", 3, list(model.parameters()),
                                               torch.optim.SGD(model.parameters(), lr=0.1)), "excuse")
    throwaway = iter(range(1000, 2000))

    def records(endpoint: str) -> dict[int, Progress]:
        now = time.time()
        return {980: Progress(0, 0, 1.0, now, endpoint, ACCUMULATING, "0123abcd", 3),
                next(throwaway): Progress(10, 0, 1.0, now, endpoint, ACCUMULATING, "0123abcd", 3)}

    with pinning_swarm(bootstrap, "excuse", records, lambda: state) as (_, server):
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), dht, "excuse", 100,
                refresh_period=0.2, progress_ttl=30.0, client_mode=True, failed_download_share=1.0) as collab:
            wait_until(lambda: collab.wait_for_trainers(count=100, timeout=0.2) is not None and
                       caplog.text.count("which served step 0 (lineage 0123abcd)") >= 5)
    # the first throwaway record's, and the download of 980's state (this joiner takes the canonical lineage); the
    # other throwaway records were passed over undialed
    assert server.downloads <= 2 and caplog.text.count("the lie was trainer") == 1, caplog.text


def test_a_record_backing_an_honest_servers_old_state_keeps_no_trainer_from_its_new_one(bootstrap, caplog,
                                                                                       monkeypatch):
    """Review 117 D1: anyone may write the record that backs a refusal. A record kept at an honest trainer's step,
    and one claiming a step more, pinned what it served for as long as the first stood: once it stepped on, its own
    records were banned, and a trainer that fell behind never caught up from it. A pin lasts PIN_SECONDS."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    monkeypatch.setattr(collab_optimizer, "PIN_SECONDS", 1.0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    served = {"step": 0, "lineage": "0123abcd"}
    states = {}

    def state() -> bytes:
        key = (served["step"], served["lineage"])
        if key not in states:
            states[key] = encode_state(TrainingState.capture(*key, 3, list(model.parameters()), opt), "pin")
        return states[key]

    def records(endpoint: str) -> dict[int, Progress]:
        now = time.time()
        return {10: Progress(0, 0, 1.0, now, endpoint, ACCUMULATING, "0123abcd", 3),  # kept at the old step
                11: Progress(1, 0, 1.0, now, endpoint, ACCUMULATING, "0123abcd", 3),  # a step more: refused
                5000: Progress(served["step"], 0, 1.0, now, endpoint, ACCUMULATING, served["lineage"], 3)}  # its own

    with pinning_swarm(bootstrap, "pin", records, state) as (_, server):
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), dht, "pin", 100,
                refresh_period=0.2, progress_ttl=30.0, client_mode=True, failed_download_share=1.0) as collab:
            wait_until(lambda: collab.wait_for_trainers(count=100, timeout=0.2) is not None and
                       "the lie was trainer 11's" in caplog.text)
            served.update(step=2, lineage="feedbeef")  # it steps on twice: this trainer missed those rounds
            wait_until(lambda: collab.wait_for_trainers(count=100, timeout=0.2) is not None and
                       collab.local_step == 2)
    assert "downloaded the state at step 2 from trainer" in caplog.text


def test_hostile_servers_each_backed_by_a_record_of_their_own_keep_no_joiner_from_an_honest_one(bootstrap, caplog):
    """Review 119 D1: three hostile servers, each serving step 0 under a record of its own and named by fresh
    throwaway records claiming step 100, refused each download after 1 s: each refusal excused, none struck, each
    charged to the failed-download budget, which they kept spent, so a joiner never reached the honest trainer at
    step 2. A refusal is excused only when quick (an honest server answers at once): these are struck and banned."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")

    class SlowStepZero(StateServicer):
        async def download_state(self, request, context):
            await asyncio.sleep(1.2)  # (within slow_refusal: never banned for its time alone)
            await context.write(dmoe_pb2.StatePart(run_id=self.run_id, step=0, lineage="0123abcd"))
            await asyncio.sleep(10)

    model = torch.nn.Linear(3, 2)
    state = encode_state(TrainingState.capture(2, "feedbeef", 3, list(model.parameters()),
                                               torch.optim.SGD(model.parameters(), lr=0.1)), "starve")
    throwaway = iter(range(1000, 100_000))
    with contextlib.ExitStack() as stack:
        hostile = [stack.enter_context(StateServer(SlowStepZero("starve", lambda: None))).endpoint for _ in range(3)]

        def records(honest: str) -> dict[int, Progress]:
            now = time.time()
            mine = {5000: Progress(2, 0, 1.0, now, honest, ACCUMULATING, "feedbeef", 3)}
            for i, endpoint in enumerate(hostile):
                mine[980 + i] = Progress(0, 0, 1.0, now, endpoint, ACCUMULATING, "0123abcd", 3)
                mine[next(throwaway)] = Progress(100 - i, 0, 1.0, now, endpoint, ACCUMULATING, "0123abcd", 3)
            return mine

        with pinning_swarm(bootstrap, "starve", records, lambda: state) as (_, honest), \
                DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                    torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), dht, "starve", 100,
                    refresh_period=0.2, progress_ttl=30.0, client_mode=True, state_timeout=8.0,
                    failed_download_share=1.0) as collab:
            wait_until(lambda: collab.wait_for_trainers(count=100, timeout=0.2) is not None and
                       all(collab.tracker.endpoint_banned(endpoint) for endpoint in hostile), timeout=60)
            wait_until(lambda: collab.wait_for_trainers(count=100, timeout=0.2) is not None and
                       collab.local_step == 2)
    assert "downloaded the state at step 2 from trainer 5000" in caplog.text


def test_finish_waits_for_the_trainers_it_trained_with_not_for_anyones_record_behind(bootstrap, caplog):
    """Anyone's record kept at a lower step made every trainer's finish() wait finish_timeout and say its model
    may differ from the others' (review 107 D3): it is named and not waited for now."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    with DHT([bootstrap], client_mode=True) as hostile, DHT([bootstrap], client_mode=True) as dht:
        now = time.time()
        hostile.store(progress_key("behind"), 777, Progress(0, 0, 0.0, now, None, ACCUMULATING, "0123abcd",
                                                            0).encode(), now + 60)
        model = torch.nn.Linear(3, 2)
        with CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, "behind", 4,
                                    refresh_period=0.2, progress_ttl=30.0, client_mode=True) as collab:
            model(torch.randn(4, 3)).sum().backward()
            assert collab.step(4) and collab.local_step == 1  # alone: 777 is on another lineage
            assert 777 in collab.collaboration.peers
            started = time.monotonic()
            assert collab.finish(timeout=5.0) is True
            assert time.monotonic() - started < 2.0
    assert "not waited for trainers [777], behind or on another lineage: none trained with this one" in caplog.text
    assert "still behind" not in caplog.text


def test_bans_of_state_servers_machines_are_dropped_once_expired():
    """Every address a record named and a download failed at stayed banned in memory for the whole run (review
    107 D1); names count in any case and port."""
    from dmoe.collab.progress import MAX_BANNED, endpoint_machine

    class Offline:  # the tracker's thread reads and publishes nothing
        config = type("DHTConfig", (), {"max_value_bytes": 96, "call_timeout": 1.0})()

        def get(self, key):
            raise TimeoutError

    tracker = ProgressTracker(Offline(), "bans", replace(CONFIG, ban_time=0.001))
    try:
        for index in range(3 * MAX_BANNED):
            tracker.ban_endpoint(f"10.{index // 250}.{index % 250}.1:5000")
            if index % MAX_BANNED == MAX_BANNED - 1:
                time.sleep(0.01)
        assert len(tracker._banned_endpoints) <= MAX_BANNED
    finally:
        tracker.close()
    assert endpoint_machine("Localhost:1") == endpoint_machine("localhost:1") != endpoint_machine("localhost:2")
    assert endpoint_machine("EVIL.example:443") == endpoint_machine("evil.example:80")


def test_a_collaboration_refuses_a_minimum_group_above_two():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="min_group_size must be 2, got 3"):
        CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, "mins", 8, min_group_size=3,
                               target_group_size=4)


def test_a_joiner_refuses_a_state_it_cannot_train_on_and_downloads_from_the_best_serving_trainer(bootstrap, caplog):
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    ahead, ahead_opt = stepped_with_scale()  # a 0-dimensional parameter too: its lineage, its state's download
    good = encode_state(TrainingState.capture(7, "0123abcd", 3, list(ahead.parameters()), ahead_opt), "join")
    broken = TrainingState.capture(9, "0123abcd", 3, list(ahead.parameters()), ahead_opt)
    broken.optimizer["param_groups"][0]["params"] = 2  # once a TypeError that killed the joiner
    bad = encode_state(broken, "join")
    partial = TrainingState.capture(8, "0123abcd", 3, list(ahead.parameters()), ahead_opt)
    only_steps(partial)  # once loaded by this fresh joiner, whose next step then raised KeyError 'exp_avg'
    with DHT([bootstrap], client_mode=True) as hostile, StateServer(StateServicer("join", lambda: good)) as server, \
            StateServer(StateServicer("join", lambda: bad)) as bad_server, \
            StateServer(StateServicer("join", lambda: encode_state(partial, "join"))) as partial_server:
        now = time.time()
        hostile.store_many({progress_key("join"): {pid: (p.encode(), now + 60) for pid, p in {
            901: Progress(10**9, 0, 0.0, now, None, ACCUMULATING, "bbbbbbbb", 1),  # above everyone, serves nothing
            902: Progress(7, 0, 1.0, now, server.endpoint, ACCUMULATING, "0123abcd", 3),
            903: Progress(9, 0, 1.0, now, bad_server.endpoint, ACCUMULATING, "0123abcd", 3),
            904: Progress(8, 0, 1.0, now, partial_server.endpoint, ACCUMULATING, "0123abcd", 3)}.items()}})
        torch.manual_seed(1)
        joiner = WithScale()
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.AdamW(joiner.parameters(), lr=0.01), dht, "join", 100, refresh_period=0.2,
                progress_ttl=30.0, client_mode=True) as collab:
            collab.wait_for_trainers(count=10, timeout=2.0)  # reads and syncs again meanwhile
            assert (collab.local_step, collab.lineage, collab.steps_downloaded) == (7, "0123abcd", 1)
            assert all(torch.equal(mine, theirs) for mine, theirs in zip(joiner.parameters(), ahead.parameters()))
    assert re.search(r"ignoring trainer 903 .*: its state at \S+ was refused: the optimizer's parameter groups "
                     r"differ: params \[2\] in the state", caplog.text), caplog.text
    assert re.search(r"ignoring trainer 904 .*: its state at \S+ was refused: the optimizer's state of parameter 0 "
                     r"holds \['step'\] in the state, \['exp_avg', 'exp_avg_sq', 'step'\] here",
                     caplog.text), caplog.text
    assert "downloaded the state at step 7 from trainer 902" in caplog.text


def hostile_states(run_id: str) -> dict[str, list[dmoe_pb2.StatePart]]:
    """Encoded AdamW states of :class:`WithScale`, each poisoned one way that once crashed the trainer that
    downloaded it (review 60): a deeply nested optimizer JSON (RecursionError), a parameter index "²" as a JSON
    key and in a tensor's name (``str.isdigit`` takes it, ``int`` raises ValueError)."""
    model = WithScale()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    states = {}
    for poison in ("nested", "json index", "tensor index"):
        messages = encode_state(TrainingState.capture(9, "0123abcd", 3, list(model.parameters()), opt), run_id)
        if poison == "nested":
            messages[0].optimizer_json = '{"param_groups": [], "state": ' + "[" * 100_000 + "]" * 100_000 + "}"
        elif poison == "json index":
            extra = json.loads(messages[0].optimizer_json)
            extra["state"]["\u00b2"] = {}
            messages[0].optimizer_json = json.dumps(extra)
        else:
            (named,) = [m for m in messages if m.name.startswith("opt.0.")][:1]
            named.name = named.name.replace("opt.0.", "opt.\u00b2.", 1)
        states[poison] = messages
    return states


def test_a_hostile_state_server_gets_banned_and_the_trainer_keeps_training(bootstrap, caplog):
    """Payloads that broke decoding past its checks raised out of the joiner's constructor, wait_for_trainers and
    step(), and the server was never banned, so a restart crashed again (review 60): each is now a refused state."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    torch.manual_seed(0)
    states = hostile_states("poison")
    for messages in states.values():
        with pytest.raises(StateDownloadError, match="malformed state"):
            decode_state(messages, 1 << 30)
    servers = [StateServer(StateServicer("poison", lambda m=m: m)) for m in states.values()]
    try:
        with DHT([bootstrap], client_mode=True) as hostile:
            now = time.time()
            ids = {921 + i: server for i, server in enumerate(servers)}
            hostile.store_many({progress_key("poison"): {pid: (Progress(
                9, 0, 1.0, now, server.endpoint, ACCUMULATING, "0123abcd", 3).encode(), now + 60)
                for pid, server in ids.items()}})
            joiner = WithScale()
            with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                    torch.optim.AdamW(joiner.parameters(), lr=0.01), dht, "poison", 100, refresh_period=0.2,
                    progress_ttl=30.0, client_mode=True) as collab:
                collab.wait_for_trainers(count=10, timeout=1.0)
                wait_until(lambda: all(f"ignoring trainer {pid} " in caplog.text for pid in ids))
                joiner(torch.randn(3, 4)).sum().backward()
                assert collab.step(3) is False  # accumulated, not crashed
                assert (collab.local_step, collab.steps_downloaded, collab.samples) == (0, 0, 3)
    finally:
        for server in servers:
            server.close()
    for pid in ids:
        assert re.search(rf"ignoring trainer {pid} .*: its state at \S+ was refused: malformed state",
                         caplog.text), caplog.text


def test_a_state_past_the_step_its_record_claims_is_refused_after_its_first_message(bootstrap, caplog):
    """A record one step ahead served a state at step 999,999,999 on any lineage and the joiner took it, which
    ends a run; and records naming an honest trainer's endpoint with a claim it does not serve had every reader
    download that whole state before refusing it, at every step (review 77). The first message decides now; one
    step past the claim is taken (the trainer stepped between the read of its record and the download)."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    ahead, ahead_opt = stepped_with_scale()
    capture = lambda step, lineage: encode_state(  # noqa: E731
        TrainingState.capture(step, lineage, 2, list(ahead.parameters()), ahead_opt), "claim")
    far, next_one = capture(999_999_999, "deadbeef"), capture(3, "feedface")
    big = torch.nn.Linear(1024, 4096)  # 16 MiB: 8 parts, more than the stream's window
    far_and_big = encode_state(TrainingState.capture(999_999_999, "deadbeef", 2, list(big.parameters()),
                                                     torch.optim.SGD(big.parameters(), lr=0.1)), "claim")
    sent: list[int] = []

    class Counted(list):  # the messages the server sent of the far state
        def __iter__(self):
            for index, message in enumerate(list.__iter__(self)):
                sent.append(index)
                yield message

    with DHT([bootstrap], client_mode=True) as hostile, \
            StateServer(StateServicer("claim", lambda: far)) as far_server, \
            StateServer(StateServicer("claim", lambda: Counted(far_and_big))) as big_server, \
            StateServer(StateServicer("claim", lambda: next_one)) as honest:
        with pytest.raises(StateMismatch, match="no"):
            download_state(big_server.endpoint, "claim", 10, 1 << 30,
                           check_head=lambda step, lineage: (_ for _ in ()).throw(StateMismatch("no")))
        # not the whole state (how many parts gRPC took before the cancel depends on its flow-control window, which
        # grows with the measured bandwidth: 7 of the 9 on a loaded machine)
        assert len(sent) < len(far_and_big)
        now = time.time()
        hostile.store_many({progress_key("claim"): {pid: (p.encode(), now + 60) for pid, p in {
            931: Progress(3, 0, 1.0, now, far_server.endpoint, ACCUMULATING, "0123abcd", 2),
            932: Progress(2, 0, 1.0, now, honest.endpoint, ACCUMULATING, "0123abcd", 2)}.items()}})
        torch.manual_seed(1)
        joiner = WithScale()
        with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.AdamW(joiner.parameters(), lr=0.01), dht, "claim", 100, refresh_period=0.2,
                progress_ttl=30.0, client_mode=True) as collab:
            wait_until(lambda: collab.wait_for_trainers(count=10, timeout=0.2) and collab.local_step == 3)
            assert (collab.lineage, collab.steps_downloaded) == ("feedface", 1)
    assert re.search(r"ignoring trainer 931 for 5 s: its state at \S+ was refused: it claims step 3 but serves step "
                     r"999999999, more than one step further", caplog.text), caplog.text
    assert "downloaded the state at step 3 from trainer 932" in caplog.text


def test_a_trainer_that_stepped_twice_since_its_record_was_read_is_downloaded_from_not_banned(bootstrap, caplog):
    """A trainer back from a pause reads records up to a refresh period old: a partner that stepped twice meanwhile
    was banned as serving "more than one step further" (review 83). Its record read again says so: no ban."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepped = encode_state(TrainingState.capture(5, "feedface", 2, list(model.parameters()), opt), "fast")
    with DHT([bootstrap], client_mode=True) as fast:
        def publish(step: int, lineage: str, endpoint: str) -> None:
            now = time.time()
            fast.store(progress_key("fast"), 951, Progress(step, 0, 1.0, now, endpoint, ACCUMULATING, lineage,
                                                           2).encode(), now + 60)

        def provide():  # it publishes its new step as the download begins: the joiner read the old one
            publish(5, "feedface", server.endpoint)
            return stepped

        with StateServer(StateServicer("fast", provide)) as server:
            publish(3, "0123abcd", server.endpoint)
            with DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                    torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.1), dht, "fast", 100,
                    refresh_period=0.2, progress_ttl=30.0, client_mode=True) as collab:
                wait_until(lambda: collab.wait_for_trainers(count=10, timeout=0.2) and collab.local_step == 5)
                assert collab.steps_downloaded == 1
    assert "stepped on since its record was read" in caplog.text and "ignoring trainer 951" not in caplog.text


def test_finish_takes_no_state_past_its_own_step(bootstrap, caplog):
    """finish() compared its limit with the step a record claimed, not with the state it downloaded (review 77)."""
    caplog.set_level(logging.INFO, logger="dmoe.collab")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    moved_on = encode_state(TrainingState.capture(6, "cafecafe", 3, list(model.parameters()), opt), "fin")
    with DHT([bootstrap], client_mode=True) as hostile, \
            StateServer(StateServicer("fin", lambda: moved_on)) as server, \
            DHT([bootstrap], client_mode=True) as dht, CollaborativeOptimizer(
                torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.1), dht, "fin", 100, refresh_period=0.2,
                progress_ttl=30.0, client_mode=True, step=5) as collab:
        now = time.time()
        hostile.store(progress_key("fin"), 941, Progress(5, 0, 1.0, now, server.endpoint, ACCUMULATING, "0000aaaa",
                                                         256).encode(), now + 60)
        assert collab.finish(timeout=1.5) is True  # 941 never trained with it (review 107 D3): not waited for
        assert (collab.local_step, collab.steps_downloaded) == (5, 0)
    assert "no state downloaded from trainer 941: it serves step 6, past step 5, the last this download may " \
           "take" in caplog.text


def test_a_trainer_whose_progress_id_another_key_took_publishes_under_a_new_one(bootstrap, caplog):
    """A progress id is public and anyone's to take once its entry lapsed; the trainer, refused at every publish,
    was invisible to the others for the rest of the run (review 77). It draws another id now."""
    caplog.set_level(logging.WARNING, logger="dmoe.collab.progress")
    with DHT([bootstrap], client_mode=True) as dht, DHT([bootstrap], client_mode=True) as squatter, \
            DHT([bootstrap], client_mode=True) as other_dht:
        squatter.store(progress_key("squat"), 4242, progress(step=0, phase=GONE).encode(), time.time() + 120)
        tracker = ProgressTracker(dht, "squat", CONFIG, 4242, progress(step=0, samples=5))
        other = ProgressTracker(other_dht, "squat", CONFIG)
        try:
            wait_until(lambda: tracker.peer_id != 4242)
            wait_until(lambda: tracker.peer_id in other.refresh_now())
            assert other.state().peers[tracker.peer_id].samples == 5
        finally:
            tracker.close()
            other.close()
    assert f"another DHT key took this trainer's progress id 4242; publishing as {tracker.peer_id}" in caplog.text


def test_refused_records_under_ever_new_ids_are_not_logged_one_line_each(bootstrap, caplog):
    """A writer cycling fresh ids under malformed entries had every trainer log a line per id and keep each id
    forever (review 77): at most 100 such warnings an hour now."""
    caplog.set_level(logging.WARNING, logger="dmoe.collab.progress")
    with DHT([bootstrap], client_mode=True) as dht, DHT([bootstrap], client_mode=True) as hostile:
        reader = ProgressTracker(dht, "flood", CONFIG)
        try:
            expiration = time.time() + 60
            hostile.store_many({progress_key("flood"): {3000 + i: ("not;a;record", expiration) for i in range(150)}})
            wait_until(lambda: len(reader.dht.get(progress_key("flood"))) == 150)
            reader.refresh_now()
            refusals = [r for r in caplog.records if "refused the progress record" in r.getMessage()]
            assert len(refusals) == 100
        finally:
            reader.close()


def test_a_state_source_that_cannot_be_reached_is_banned_by_machine_not_by_port(bootstrap):
    """Records pointing at a new port of one address each time got past a ban of the last HOST:PORT, and every
    try cost a trainer a connection timeout (review 53); on loopback each ip:port stays a machine of its own."""
    from dmoe.collab.progress import endpoint_machine

    assert endpoint_machine("10.6.6.6:1000") == endpoint_machine("10.6.6.6:2000") != endpoint_machine("10.6.6.7:1000")
    assert endpoint_machine("[2001:db8::1]:1") == endpoint_machine("[2001:db8::2]:2")  # one /64
    assert endpoint_machine("127.0.0.1:1000") != endpoint_machine("127.0.0.1:2000")
    with DHT([bootstrap], client_mode=True) as dht, DHT([bootstrap], client_mode=True) as hostile:
        reader = ProgressTracker(dht, "rotate", CONFIG)
        try:
            expiration = time.time() + 30
            for peer_id, port in ((71, 1000), (72, 2000)):
                hostile.store(progress_key("rotate"), peer_id, progress(step=9, endpoint=f"10.6.6.6:{port}").encode(),
                              expiration)
            wait_until(lambda: {71, 72} <= set(reader.state().peers))
            assert reader.ban_endpoint("10.6.6.6:1000") == CONFIG.ban_time
            reader.refresh_now()
            assert {reader.state().peers[pid].endpoint for pid in (71, 72)} == {None}  # the other port too
        finally:
            reader.close()
