"""Replicas are other servers' input (review 78): whatever a signer puts in one, and however slowly or craftily a
pusher sends it, costs a holder, an adopter or a new server no more than refusing it, and one expert's bad replica
costs an adoption or a restore that expert alone. Holders and fake holders are in-process gRPC servers on 127.0.0.1
(ephemeral ports); the DHT is in-process nodes."""
from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from concurrent import futures
from contextlib import ExitStack
from contextlib import closing as contextlib_closing
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest
import torch

from dmoe.dht import DHT, Identity
from dmoe.replicas import (
    ReplicaChannels,
    ReplicaError,
    ReplicaServicer,
    ReplicaStore,
    SnapshotRefused,
    check_state,
    fetch_snapshot,
    load_into,
    open_body,
    push_snapshot,
    restore_newest,
    sign,
    take,
)
from dmoe.replicas.adoption import Adopter
from dmoe.replicas.pusher import PROBE_MESSAGE_BYTES, fetch_headers
from dmoe.replicas.records import SIGNER_HEX, Holder, directory_entries, replicas_key, server_subkey
from dmoe.replicas.snapshots import CHUNK_BYTES, SignedSnapshot, max_tensors, signed_fields
from dmoe.server import ExpertServer, ServerConfig
from dmoe.wire import dmoe_pb2, dmoe_pb2_grpc, grpc_options, serialize
from tests.test_replicas import wait_until

HIDDEN = 8
MAX_BYTES = 1 << 30


def expert_server(uids: str = "ffn0.1.2") -> ExpertServer:
    """An unstarted server of adam-trained ffn experts (a template and a backend factory)."""
    return ExpertServer.create(uids, "ffn", HIDDEN, optimizer="adam", lr=0.01, config=ServerConfig(device="cpu"))


def train(backend, steps: int):
    for _ in range(steps):
        backend.backward(torch.randn(4, HIDDEN), torch.randn(4, HIDDEN))
        backend.backward_calls += 1
    return backend


def trained(uid: str, steps: int):
    return train(expert_server(uid).backends[uid], steps)


def with_steps(snapshot: dmoe_pb2.Snapshot, value: float, updates: int) -> dmoe_pb2.Snapshot:
    """``snapshot`` with every optimizer step counter set to ``value``, claiming ``updates`` updates."""
    changed = dmoe_pb2.Snapshot()
    changed.CopyFrom(snapshot)
    for named in changed.tensors:
        if named.name.endswith(".step"):
            named.tensor.CopyFrom(serialize(torch.tensor(value)))
    changed.updates = changed.backward_calls = updates
    return changed


def poisoned(uid: str, owner: Identity) -> SignedSnapshot:
    """A replica of ``uid`` genuinely signed by ``owner`` whose Adam step counters are +inf, claiming 1000 updates."""
    return sign(with_steps(take(trained(uid, 2)), float("inf"), 1000), owner)


def another_optimizers(uid: str, owner: Identity, steps: int) -> SignedSnapshot:
    """A replica that passes the state check but whose param_groups are an SGD's: loading it into an Adam expert
    raises ValueError (check_state does not look at the groups' settings)."""
    snapshot = take(trained(uid, steps))
    snapshot.layout_json = snapshot.layout_json.replace('["betas", {"u": [{"v": 0.9}, {"v": 0.999}]}]',
                                                        '["momentum", {"v": 0.9}]')
    assert '"momentum"' in snapshot.layout_json
    return sign(snapshot, owner)


class Holding(dmoe_pb2_grpc.ReplicaServiceServicer):
    """A holder's replica service serving the replicas it is given, as they are."""

    def __init__(self, replicas: dict[str, SignedSnapshot]):
        self.replicas = replicas

    def fetch(self, request: dmoe_pb2.ReplicaQuery, context) -> Iterator[dmoe_pb2.ReplicaChunk]:
        if request.uid not in self.replicas:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no replica of {request.uid}")
        yield from self.replicas[request.uid].chunks()


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def fake_holder(stack: ExitStack, replicas: dict[str, SignedSnapshot], announcer: DHT) -> str:
    """Serves ``replicas`` on 127.0.0.1 and announces each, from ``announcer``'s key, as held there."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    dmoe_pb2_grpc.add_ReplicaServiceServicer_to_server(Holding(replicas), server)
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    stack.callback(server.stop, None)
    for uid, signed in replicas.items():
        value = Holder(endpoint, signed.updates, signed.header.signer.hex()[:SIGNER_HEX], b"").value()
        assert announcer.store(replicas_key(uid), server_subkey(announcer.identity.public_key), value,
                               time.time() + 120)
    return endpoint


# ---- D1: a step count that is no count ----------------------------------------------------------------------------

@pytest.mark.parametrize("step, updates", [(float("inf"), 1000), (float("nan"), 3), (2.5, 2), (-1.0, 0)])
def test_a_step_count_that_is_no_whole_number_of_steps_is_refused_not_raised(step, updates):
    """int(+inf) raised OverflowError and int(nan) a plain ValueError out of the state check; 2.5 steps passed
    as 2 (review 78)."""
    backend = trained("ffn0.1.2", 2)
    snapshot = with_steps(take(backend), step, updates)
    with pytest.raises(SnapshotRefused) as refused:
        check_state(snapshot, backend)
    assert refused.value.reason == "updates" and refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a count of steps" in refused.value.message
    check_state(with_steps(take(backend), 2.0, 2), backend)  # a float counter that is a count is one


def test_a_new_server_whose_only_replica_is_poisoned_starts_as_it_is_instead_of_dying(stack, tmp_path):
    """A throwaway key announced itself the only holder of a free cell's replica, signed by itself with +inf steps:
    a new --replica-dir server that took the cell died in its restore, before it served (review 78)."""
    uid, attacker = "ffn0.4.4", Identity()
    first = stack.enter_context(DHT())
    evil = stack.enter_context(DHT([first.endpoint], identity=attacker))
    fake_holder(stack, {uid: poisoned(uid, attacker)}, evil)
    victim = stack.enter_context(DHT([first.endpoint]))
    server, channels = expert_server(f"{uid},ffn0.4.5"), ReplicaChannels()
    stack.callback(channels.close)
    before = server.backends[uid].module.ffn[0].weight.detach().clone()
    restored = restore_newest(server, victim, [uid, "ffn0.4.5"], channels, max_bytes=MAX_BYTES,
                              store=stack.enter_context(ReplicaStore(tmp_path, MAX_BYTES)))
    assert restored == {}
    assert server.backends[uid].updates == 0
    assert torch.equal(server.backends[uid].module.ffn[0].weight, before)


def test_one_experts_bad_replica_costs_an_adoption_that_expert_alone(stack, tmp_path):
    """H holds B's replicas of four empty cells. ffn0.2.2's cannot be loaded (an SGD's param_groups), and a holder
    entry serves a +inf-step replica of ffn0.3.3 signed by its owner. One exception out of a uid used to abort the
    whole adoption: the uids before it served by H but never claimed nor declared (lost to every client), those
    after it never adopted, again at every look (review 78). Now each uid stands alone: ffn0.3.3 is adopted from
    the replica H holds, ffn0.2.2 is not adopted, the others are, and all that H serves is declared."""
    b = Identity()
    first = stack.enter_context(DHT())
    throwaway = stack.enter_context(DHT([first.endpoint]))
    node = stack.enter_context(DHT([first.endpoint]))
    store = stack.enter_context(ReplicaStore(tmp_path, MAX_BYTES))
    uids = ["ffn0.1.1", "ffn0.2.2", "ffn0.3.3", "ffn0.4.4"]
    store.put(sign(take(trained("ffn0.1.1", 5)), b))
    store.put(another_optimizers("ffn0.2.2", b, 4))
    store.put(sign(take(trained("ffn0.3.3", 3)), b))
    store.put(sign(take(trained("ffn0.4.4", 2)), b))
    fake_holder(stack, {"ffn0.3.3": poisoned("ffn0.3.3", b)}, throwaway)
    channels = ReplicaChannels()
    stack.callback(channels.close)
    server = stack.enter_context(expert_server("ffn0.0.0"))
    adopter = Adopter(server, node, store, ["ffn0"], check_period=1.0, stagger=0.0, channels=channels,
                      max_bytes=MAX_BYTES, expiration=30.0)
    assert adopter.adopt(uids) == ["ffn0.1.1", "ffn0.3.3", "ffn0.4.4"]
    assert sorted(server.backends) == ["ffn0.0.0", "ffn0.1.1", "ffn0.3.3", "ffn0.4.4"]
    assert [server.backends[uid].updates for uid in ("ffn0.1.1", "ffn0.3.3", "ffn0.4.4")] == [5, 3, 2]
    entries = directory_entries(node, uids)
    assert {uid for uid, entry in entries.items() if entry is not None and entry.owner == node.identity.public_key} \
        == {"ffn0.1.1", "ffn0.3.3", "ffn0.4.4"}
    assert entries["ffn0.2.2"] is None and list(adopter.held_elsewhere()) == ["ffn0.2.2"]


# ---- a holder: a ReplicaServicer on 127.0.0.1 ---------------------------------------------------------------------

class LiveHolder:
    """A :class:`ReplicaServicer` of layer ffn0 on a gRPC server of its own event loop (a thread), on 127.0.0.1 at
    an ephemeral port, closed with ``stack``. The directory's owner of each uid is what :attr:`owners` says."""

    def __init__(self, stack: ExitStack, directory: Path, budget: int = MAX_BYTES, **options):
        self.owners: dict[str, bytes] = {}
        self.store = stack.enter_context(ReplicaStore(directory, budget))
        self.template = expert_server("ffn0.0.0").backends["ffn0.0.0"]
        self.servicer = ReplicaServicer(self.store, self.template, self.owners.get, layers=["ffn0"], **options)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-replica-holder", daemon=True)
        self._thread.start()

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(options=grpc_options())  # (a server's: messages of up to 64 MiB)
            self.servicer.add_to_server(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port
        self.server, port = self.run(start())
        self.endpoint = f"127.0.0.1:{port}"
        self.channels = ReplicaChannels()
        self.stub = self.channels.stub(self.endpoint)
        stack.callback(self.close)

    def run(self, coroutine, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def held(self, uid: str) -> int:
        return fetch_snapshot(self.stub, self.endpoint, uid, max_bytes=MAX_BYTES).updates

    def close(self) -> None:
        self.channels.close()
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


def refusal(stub, chunks) -> grpc.RpcError:
    """The error a push of ``chunks`` ends with (fails the test if it is taken)."""
    with pytest.raises(grpc.RpcError) as refused:
        stub.push(chunks, timeout=60)
    return refused.value


def test_a_pushed_replica_with_an_infinite_step_count_is_refused_with_a_clear_status(stack, tmp_path):
    """It was answered UNKNOWN ("Unexpected <class 'OverflowError'>"), counted as no refusal (review 78)."""
    owner, uid = Identity(), "ffn0.1.2"
    holder = LiveHolder(stack, tmp_path)
    holder.owners[uid] = owner.public_key
    backend = trained(uid, 3)
    assert push_snapshot(holder.stub, holder.endpoint, sign(take(backend), owner)) == 3
    error = refusal(holder.stub, poisoned(uid, owner).chunks())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "optimizer state optimizer.state.0.step is inf, not a count of steps" in error.details()
    assert holder.held(uid) == 3


# ---- D3: tensors beyond what the experts can have ------------------------------------------------------------------

def test_tensors_beyond_what_the_experts_can_have_or_outside_the_state_are_refused(stack, tmp_path):
    """A genuine snapshot plus empty tensors was accepted: millions of them (15 bytes each) cost the holder's state
    check ~14x their bytes in memory and ~1 s of CPU per MiB (review 78). Counted before they are parsed now."""
    owner, uid = Identity(), "ffn0.1.2"
    holder = LiveHolder(stack, tmp_path)
    holder.owners[uid] = owner.public_key
    backend = trained(uid, 2)
    assert push_snapshot(holder.stub, holder.endpoint, sign(take(backend), owner)) == 2
    train_more = trained(uid, 3)
    cap = max_tensors(holder.template)
    for extra, words in ((cap, f"more than the {cap} a snapshot of this server's experts can have"),
                         (3, "3 of its tensors are in no part of its state")):
        snapshot = take(train_more)
        for _ in range(extra):
            snapshot.tensors.add(name="", tensor=serialize(torch.zeros(0)))
        signed = sign(snapshot, owner)
        error = refusal(holder.stub, signed.chunks())
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.details(), error
        with pytest.raises(SnapshotRefused, match=words):  # and by an adopter
            check_state(open_body(signed, max_tensors(backend)), backend)
    assert holder.held(uid) == 2
    assert push_snapshot(holder.stub, holder.endpoint, sign(take(train_more), owner)) == 3  # the genuine one


# ---- D4: a push that trickles ------------------------------------------------------------------------------------

def test_a_push_that_falls_behind_the_minimum_rate_is_ended_and_one_that_keeps_up_is_taken(stack, tmp_path):
    """Only a message that took longer than the stall limit ended a push: a byte sent every (limit - epsilon) kept
    one open for ever, holding a push slot and its announced bytes (review 78). Each byte now buys the push
    1/min_push_rate s beyond an allowance; an honest push that sends faster than that takes as long as it needs."""
    owner, uid = Identity(), "ffn0.1.2"
    holder = LiveHolder(stack, tmp_path, stall_seconds=1.0, push_allowance=2.0, min_push_rate=2048)
    holder.owners[uid] = owner.public_key
    signed = sign(take(trained(uid, 2)), owner)
    stop = threading.Event()
    stack.callback(stop.set)

    def trickle() -> Iterator[dmoe_pb2.ReplicaChunk]:  # a byte every 0.2 s: never stalled for 1 s, for up to 30 s
        yield dmoe_pb2.ReplicaChunk(header=signed.header, data=signed.body[:1])
        for i in range(1, 150):
            if stop.wait(0.2):
                return
            yield dmoe_pb2.ReplicaChunk(data=signed.body[i:i + 1])
        stop.wait(30)

    started = time.monotonic()
    error = refusal(holder.stub, trickle())
    stop.set()
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert f"the push of {uid} is too slow" in error.details(), error.details()
    assert time.monotonic() - started < 10
    wait_until(lambda: not holder.servicer._open["push"] and not holder.servicer._announced, 10,
               "the holder letting go of the push's place and announced bytes")

    def keeping_up() -> Iterator[dmoe_pb2.ReplicaChunk]:  # 1 KiB every 0.3 s: longer than the allowance in all
        chunks = list(signed.chunks(1024))
        yield chunks[0]
        for chunk in chunks[1:]:
            time.sleep(0.3)
            yield chunk
    assert len(signed.body) > 7 * 1024  # (> 2 s)
    assert holder.stub.push(keeping_up(), timeout=60).updates == 2


def test_one_machine_may_announce_only_a_share_of_the_budget_in_open_pushes(stack, tmp_path):
    """Each open push counted its announced size against the budget until it ended (which a trickle could put off
    for ever): a machine's 7 or 8 pushes announcing the largest snapshot, and a second machine's, took it all, and
    every honest push was refused RESOURCE_EXHAUSTED (review 78). A machine may announce a quarter of it now."""
    owner, attacker, uid = Identity(), Identity(), "ffn0.1.2"
    probe = LiveHolder(stack, tmp_path / "probe")
    largest = probe.servicer.max_bytes
    holder = LiveHolder(stack, tmp_path / "held", budget=8 * largest)
    holder.owners[uid] = owner.public_key
    release = threading.Event()
    stack.callback(release.set)

    def header(fake: str) -> dmoe_pb2.ReplicaHeader:  # announcing the largest snapshot; its bytes never come
        holder.owners[fake] = attacker.public_key
        made_up = dmoe_pb2.ReplicaHeader(uid=fake, updates=0, size=largest, sha256=hashlib.sha256(fake.encode())
                                         .digest(), taken_at=time.time(), signer=attacker.public_key)
        made_up.signature = attacker.sign(*signed_fields(made_up))
        return made_up

    async def holding(first: dmoe_pb2.ReplicaHeader) -> AsyncIterator[dmoe_pb2.ReplicaChunk]:
        yield dmoe_pb2.ReplicaChunk(header=first, data=b"x")
        while not release.is_set():
            await asyncio.sleep(0.05)

    async def open_pushes(machine: str, count: int) -> tuple[list[asyncio.Task], list[SnapshotRefused]]:
        opened, refused = [], []
        for i in range(count):
            before = holder.servicer._announced_by[machine]
            task = asyncio.ensure_future(holder.servicer._receive(holding(header(f"ffn0.9.{len(machine)}{i}")),
                                                                  machine))
            while not task.done() and holder.servicer._announced_by[machine] == before:
                await asyncio.sleep(0.01)  # (until its header is checked, and its size counted or refused)
            if task.done():
                refused.append(task.exception())
            else:
                opened.append(task)
        return opened, refused

    open_pushes_of = {machine: holder.run(open_pushes(machine, 4)) for machine in ("192.0.2.1", "198.51.100.22")}
    for machine, (opened, refused) in open_pushes_of.items():
        assert len(opened) == 2 and len(refused) == 2, (machine, refused)
        assert refused[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"the replicas this server receives from {machine} now announce {2 * largest} bytes" in \
            refused[0].message
    assert holder.servicer._announced == 4 * largest
    assert push_snapshot(holder.stub, holder.endpoint, sign(take(trained(uid, 2)), owner)) == 2  # another machine
    release.set()

    async def ended() -> list[BaseException | None]:
        tasks = [task for opened, _ in open_pushes_of.values() for task in opened]
        return [result for result in await asyncio.gather(*tasks, return_exceptions=True)]
    assert all(isinstance(result, SnapshotRefused) and result.reason == "truncated" for result in holder.run(ended()))
    assert holder.servicer._announced == 0 and not holder.servicer._announced_by


# ---- D5: a replay that began before a newer push and ended after it ----------------------------------------------

def test_a_replica_that_became_older_than_the_one_held_during_its_push_is_refused_at_the_commit(stack, tmp_path):
    """The owner and "not older than held" were checked at the header only, and the commit renamed over whatever
    was held then: a replay of the owner's older replica (anyone may fetch one), begun before the owner's newer push
    and finished after it, rolled the holder back (review 78). Likewise a push the owner began before another key
    took the uid over."""
    owner, uid = Identity(), "ffn0.1.2"
    holder = LiveHolder(stack, tmp_path)
    holder.owners[uid] = owner.public_key
    backend = trained(uid, 0)
    r3, r5, r8, r9 = (sign(take(train(backend, steps)), owner) for steps in (3, 2, 3, 1))
    assert push_snapshot(holder.stub, holder.endpoint, r3) == 3
    go = threading.Event()
    stack.callback(go.set)

    def begun_then_held(signed: SignedSnapshot) -> Iterator[dmoe_pb2.ReplicaChunk]:
        chunks = list(signed.chunks(1024))
        yield chunks[0]
        go.wait(60)
        yield from chunks[1:]

    def begin(signed: SignedSnapshot):
        go.clear()
        call = holder.stub.push.future(begun_then_held(signed), timeout=60)
        wait_until(lambda: holder.servicer._announced == signed.header.size, 10, "the holder reading its header")
        return call

    replay = begin(r5)
    assert push_snapshot(holder.stub, holder.endpoint, r8) == 8
    go.set()
    error = replay.exception(60)
    assert error is not None and error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
    assert "this server holds a newer replica of ffn0.1.2 (8 updates) from the same owner" in error.details()
    assert holder.held(uid) == 8

    late = begin(r9)
    holder.owners[uid] = Identity().public_key  # another key owns the uid before the push ends
    go.set()
    error = late.exception(60)
    assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED, error
    assert "which does not own it" in error.details()
    assert holder.held(uid) == 8
    with pytest.raises(ReplicaError) as refused:  # (and at the header, as before)
        push_snapshot(holder.stub, holder.endpoint, r5)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED


# ---- review 88 D4: an optimizer state with buffers missing ----------------------------------------------------------

def with_optimizer_state(snapshot: dmoe_pb2.Snapshot, edit) -> dmoe_pb2.Snapshot:
    """``snapshot`` with its optimizer's per-parameter state edited (``edit(index, pairs)`` -> the [key, node]
    pairs of the layout to keep), its tensors renumbered so that none is left out of the state."""
    changed = dmoe_pb2.Snapshot()
    changed.CopyFrom(snapshot)
    tree = json.loads(changed.layout_json)
    state = dict(dict(tree["d"])["optimizer"]["d"])["state"]  # (its nodes: edited in place)
    state["d"] = [[index, {"d": pairs}] for index, per_parameter in state["d"]
                  if (pairs := edit(index, per_parameter["d"])) is not None]
    used: list[int] = []

    def renumber(node):
        if isinstance(node, dict):
            if set(node) == {"t"}:
                if node["t"] not in used:
                    used.append(node["t"])
                return {"t": used.index(node["t"])}
            return {key: renumber(value) for key, value in node.items()}
        return [renumber(value) for value in node] if isinstance(node, list) else node
    tree = renumber(tree)
    tensors = [changed.tensors[index] for index in used]
    del changed.tensors[:]
    changed.tensors.extend(tensors)
    changed.layout_json = json.dumps(tree)
    return changed


def dropping(*keys: str):
    return lambda index, pairs: [[key, node] for key, node in pairs if key not in keys]


BROKEN_STATES = {
    "without exp_avg_sq": (dropping("exp_avg_sq"), "holds ['exp_avg', 'step'], this server's Adam keeps"),
    "without exp_avg_sq and step": (dropping("exp_avg_sq", "step"), "holds ['exp_avg'], this server's Adam keeps"),
    "without step": (dropping("step"), "holds ['exp_avg', 'exp_avg_sq'], this server's Adam keeps"),
    "with a buffer more": (lambda index, pairs: pairs + [["max_exp_avg_sq", dict(pairs)["exp_avg"]]],
                           "holds ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step']"),
    "with a step that is no tensor": (lambda index, pairs: [[key, {"v": 3.0} if key == "step" else node]
                                                            for key, node in pairs], "step of parameter 0 is 3.0"),
    "with a step of another shape": (lambda index, pairs: [[key, dict(pairs)["exp_avg"] if key == "step" else node]
                                                           for key, node in pairs],
                                     "optimizer state step of parameter 0 is"),
    "with no state, claiming updates": (lambda index, pairs: None, "3 updates, but its optimizer state has taken no"),
}


@pytest.mark.parametrize("broken", BROKEN_STATES)
def test_an_optimizer_state_missing_a_buffer_or_the_step_count_is_refused(broken):
    """An Adam state without exp_avg_sq passed the check, was held and adopted, and the adopted expert then failed
    every training step with KeyError 'exp_avg_sq'; without its step counters the update count went unchecked and
    the load failed (review 88). Each parameter's state must be empty or hold exactly what the receiver's own
    optimizer keeps for it, each a tensor of its shape."""
    edit, message = BROKEN_STATES[broken]
    backend = trained("ffn0.1.2", 3)
    snapshot = with_optimizer_state(take(backend), edit)
    template = expert_server("ffn0.1.2").backends["ffn0.1.2"]
    with pytest.raises(SnapshotRefused) as refused:
        check_state(open_body(sign(snapshot, Identity()), max_tensors(template)), template)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.message, \
        refused.value.message


def test_optimizer_states_that_fit_are_taken_and_train_on():
    """What a genuine expert has: no state before its first step; none for a parameter that never had a gradient;
    none at all for SGD without momentum, after any number of steps."""
    untrained = expert_server("ffn0.1.2").backends["ffn0.1.2"]
    one_parameter_unstepped = with_optimizer_state(take(trained("ffn0.1.2", 3)),
                                                   lambda index, pairs: None if index == 0 else pairs)
    sgd = ExpertServer.create("ffn0.1.2", "ffn", HIDDEN, optimizer="sgd", lr=0.01,
                              config=ServerConfig(device="cpu")).backends["ffn0.1.2"]
    for snapshot, template in [(take(untrained), expert_server("ffn0.1.2").backends["ffn0.1.2"]),
                               (one_parameter_unstepped, expert_server("ffn0.1.2").backends["ffn0.1.2"]),
                               (take(train(sgd, 2)), ExpertServer.create(
                                   "ffn0.1.2", "ffn", HIDDEN, optimizer="sgd", lr=0.01,
                                   config=ServerConfig(device="cpu")).backends["ffn0.1.2"])]:
        load_into(template, snapshot, check_state(snapshot, template))
        train(template, 1)
        assert template.updates == snapshot.updates + 1


# ---- review 105 D1: messages larger than an honest one; D2: a replica of the holder's own ----------------------------

def test_a_holders_first_message_larger_than_an_honest_one_is_refused_unread(stack):
    """A header probe or a fetch read the holder's whole first message (up to gRPC's 64 MiB) before it looked at the
    header: one machine announcing many ports made an adopting or starting server hold ~75 MiB per port, all at
    once. An honest holder sends its header alone, then at most CHUNK_BYTES a message."""
    uid, owner = "ffn0.1.2", Identity()
    signed = sign(take(trained(uid, 2)), owner)

    class Fat(dmoe_pb2_grpc.ReplicaServiceServicer):
        def fetch(self, request, context):
            yield dmoe_pb2.ReplicaChunk(header=signed.header, data=bytes(8 << 20 if request.uid == uid else
                                                                          PROBE_MESSAGE_BYTES))

    server = grpc.server(futures.ThreadPoolExecutor(2), options=grpc_options())
    dmoe_pb2_grpc.add_ReplicaServiceServicer_to_server(Fat(), server)
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    stack.callback(server.stop, None)
    channels = stack.enter_context(contextlib_closing(ReplicaChannels()))
    answer = fetch_headers(channels, uid, [endpoint], max_bytes=MAX_BYTES)[endpoint]
    assert isinstance(answer, ReplicaError) and answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED, answer
    # a probe takes nothing larger than a header (review 114 D1: so that it may ask all 256 holders at once)
    answer = fetch_headers(channels, "ffn0.1.3", [endpoint], max_bytes=MAX_BYTES)[endpoint]
    assert isinstance(answer, ReplicaError) and answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED, answer
    with pytest.raises(ReplicaError) as refused:
        fetch_snapshot(channels.stub(endpoint), endpoint, uid, max_bytes=MAX_BYTES)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_header_probes_ask_every_announced_holder_at_once(stack):
    """Review 114 D1: asked 32 at a time (review 105 D1's bound on what probes hold, now PROBE_MESSAGE_BYTES each),
    255 throwaway entries at addresses that never answer cost a uid's adoption or restore 8 timeouts, per look."""
    asked: list[float] = []  # when each call came

    class Silent(dmoe_pb2_grpc.ReplicaServiceServicer):
        def fetch(self, request, context):
            asked.append(time.monotonic())
            while context.is_active():
                time.sleep(0.02)
            yield dmoe_pb2.ReplicaChunk()

    count = 72  # (a record holds up to 256)
    server = grpc.server(futures.ThreadPoolExecutor(count + 8))
    dmoe_pb2_grpc.add_ReplicaServiceServicer_to_server(Silent(), server)
    endpoints = [f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}" for _ in range(count)]
    server.start()
    stack.callback(server.stop, None)
    channels = stack.enter_context(contextlib_closing(ReplicaChannels()))
    answers = fetch_headers(channels, "ffn0.1.2", endpoints, max_bytes=MAX_BYTES, timeout=2.0)
    assert all(isinstance(answer, ReplicaError) and answer.code == grpc.StatusCode.DEADLINE_EXCEEDED
               for answer in answers.values())
    first_wave = [moment for moment in asked if moment < min(asked) + 1.0]  # (a second wave came 2 s later)
    assert len(asked) == len(first_wave) == count, sorted(m - min(asked) for m in asked)


def test_a_pushed_message_larger_than_an_honest_one_is_refused_with_a_clear_status(stack, tmp_path):
    """A push's first message was taken (and parsed) up to the server's 64 MiB before anything was checked."""
    owner, uid = Identity(), "ffn0.1.2"
    holder = LiveHolder(stack, tmp_path)
    holder.owners[uid] = owner.public_key
    signed = sign(take(trained(uid, 3)), owner)
    channel = stack.enter_context(grpc.insecure_channel(holder.endpoint, options=grpc_options()))
    stub = dmoe_pb2_grpc.ReplicaServiceStub(channel)  # (a pusher's channel that sends messages of up to 64 MiB)
    for data in (bytes(CHUNK_BYTES + 1), bytes(8 << 20)):
        error = refusal(stub, iter([dmoe_pb2.ReplicaChunk(header=signed.header, data=data)]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert f"bytes in one message: this server takes at most {CHUNK_BYTES}" in error.details()
    assert push_snapshot(holder.stub, holder.endpoint, signed) == 3 and holder.held(uid) == 3


def test_a_push_signed_by_the_holders_own_key_is_refused(stack, tmp_path):
    """Anyone may announce a server's own endpoint as a host: its pusher pushed its replicas to itself, and its own
    service took them (the signer owns the uid), where they die with it."""
    me, uid = Identity(), "ffn0.1.2"
    holder = LiveHolder(stack, tmp_path, own_key=me.public_key)
    holder.owners[uid] = me.public_key
    with pytest.raises(ReplicaError) as refused:
        push_snapshot(holder.stub, holder.endpoint, sign(take(trained(uid, 3)), me))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED and "this server's own key" in refused.value.message
    assert holder.store.header(uid) is None
