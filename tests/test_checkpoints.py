"""Expert checkpoints: a server killed with SIGKILL comes back with its experts as last saved, never half-written."""
from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from dmoe.cli import server as server_program
from dmoe.client.remote_expert import backward_future, expert_info, forward_future
from dmoe.dht import DHT
from dmoe.directory import get_experts
from dmoe.experts import create_expert
from dmoe.server import ExpertBackend, ExpertServer, ServerConfig
from dmoe.server.backend import make_optimizer
from dmoe.server.checkpoints import FILENAME, CheckpointMismatch, Checkpoints, CorruptCheckpoint, saved_uids
from tests.procs import Proc, processes

HIDDEN = 8
INTERVAL = 0.5
# a loaded 2-core CI machine may start a periodic write this late (scheduling) and take this long to finish it
WRITE_SLACK = 2.0


def server_args(checkpoint_dir, *extra: str) -> list[str]:
    return ["-m", "dmoe.cli.server", "--experts", "ck.[0:2]", "--expert-cls", "ffn", "--hidden-dim", str(HIDDEN),
            "--optimizer", "adam", "--lr", "0.01", "--torch-threads", "1", "--checkpoint-dir", str(checkpoint_dir),
            "--checkpoint-interval", str(INTERVAL), *extra]


def adam_steps(state: dict, uid: str) -> int:
    """Optimizer steps applied to ``uid`` in a checkpoint: Adam counts them per parameter."""
    return int(next(iter(state["experts"][uid]["state"]["optimizer"]["state"].values()))["step"])


def expert_from(state: dict, uid: str) -> torch.nn.Module:
    module = create_expert("ffn", HIDDEN)
    module.load_state_dict(state["experts"][uid]["state"]["module"])
    return module.eval()


def test_killed_server_restarts_from_its_last_checkpoint_losing_at_most_one_interval(tmp_path):
    x = torch.randn(16, HIDDEN)
    with processes() as procs:
        procs.append(dht_node := Proc(["-m", "dmoe.dht", "--port", "0"]))
        peer = dht_node.endpoint()
        procs.append(server := Proc(server_args(tmp_path, "--initial-peers", peer)))
        endpoint = server.endpoint()
        initial = forward_future(endpoint, "ck.0", [x]).result(timeout=30)[0]

        done_at: list[float] = []  # when each optimizer step's answer arrived
        stop = threading.Event()

        def train() -> None:
            while not stop.is_set():
                try:
                    backward_future(endpoint, "ck.0", [torch.randn(4, HIDDEN)], [torch.randn(4, HIDDEN)],
                                    timeout=10).result()
                except Exception:  # the kill below ends training mid-call
                    return
                done_at.append(time.monotonic())

        trainer = threading.Thread(target=train)
        trainer.start()
        deadline = time.monotonic() + 60
        while (len(done_at) < 20 or time.monotonic() - done_at[0] < 8 * INTERVAL) and time.monotonic() < deadline:
            time.sleep(0.05)  # training for several intervals, so several checkpoints were written
        killed_at = time.monotonic()
        server.kill()
        stop.set()
        trainer.join()
        assert len(done_at) >= 20, "the server trained too slowly to test anything"

        saved = Checkpoints(tmp_path, {}).read()
        steps = adam_steps(saved, "ck.0")
        assert steps <= len(done_at)
        assert steps >= sum(t <= killed_at - INTERVAL - WRITE_SLACK for t in done_at), (steps, len(done_at))

        procs.append(restarted := Proc(server_args(tmp_path, "--initial-peers", peer)))
        new_endpoint = restarted.endpoint()
        after = forward_future(new_endpoint, "ck.0", [x]).result(timeout=30)[0]
        with torch.no_grad():
            torch.testing.assert_close(after, expert_from(saved, "ck.0")(x))
        assert not torch.allclose(after, initial), "training changed nothing, so the restore proved nothing"
        calls = expert_info(new_endpoint, "ck.0", timeout=30)["backward_calls"]
        assert calls == saved["experts"]["ck.0"]["backward_calls"]
        assert not list(tmp_path.glob(f"{FILENAME}.*.tmp"))

        with DHT(initial_peers=[peer]) as client:  # re-announced at the new endpoint
            deadline = time.monotonic() + 30
            while get_experts(client, ["ck.0", "ck.1"]) != [new_endpoint] * 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert get_experts(client, ["ck.0", "ck.1"]) == [new_endpoint] * 2

        # a clean shutdown writes a final checkpoint holding every step taken since the last periodic one
        backward_future(new_endpoint, "ck.1", [torch.randn(4, HIDDEN)], [torch.randn(4, HIDDEN)]).result(timeout=30)
        assert restarted.stop() == 0
        assert adam_steps(Checkpoints(tmp_path, {}).read(), "ck.1") == 1


def refused_here(capsys, args: list[str]) -> str:
    """What ``dmoe-server`` (``args``: :func:`server_args`) prints as it refuses its checkpoint with status 2 (an
    argparse error), run in this process (a program of its own costs seconds of imports): a checkpoint is refused as
    the server is built, before the program starts anything (a DHT node, a thread)."""
    threads = torch.get_num_threads()  # (the program sets its --torch-threads)
    try:
        with pytest.raises(SystemExit) as exit_info:
            server_program.main(args[2:])
    finally:
        torch.set_num_threads(threads)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def save_checkpoint(directory, uids="ck.[0:2]", **kwargs) -> None:
    ExpertServer.create(uids, "ffn", HIDDEN, config=ServerConfig(device="cpu", checkpoint_dir=str(directory)),
                        **kwargs).checkpoints.save()


@pytest.mark.parametrize("change, words", [
    (dict(uids="ck.[0:3]"), "uids differ: the checkpoint holds 2 experts ck.0 .. ck.1, this server asks for "
                            "3 experts ck.0 .. ck.2; not in the checkpoint: ck.2"),
    (dict(expert_cls="nop"), "expert class was 'ffn', now 'nop' (all 2 experts)"),
    (dict(hidden_dim=16), "hidden_dim was 8, now 16"),
    (dict(hidden_dim=16), "ffn.0.weight [32, 8] -> [64, 16]"),
    (dict(cls_kwargs={"expansion": 2}), "parameter shapes differ"),
    (dict(optimizer="sgd"), "optimizer was 'adam', now 'sgd'"),
])
def test_checkpoint_of_other_experts_is_refused_naming_the_difference(tmp_path, change, words):
    save_checkpoint(tmp_path)
    kwargs = {"uids": "ck.[0:2]", "expert_cls": "ffn", "hidden_dim": HIDDEN, **change}
    with pytest.raises(CheckpointMismatch) as error:
        ExpertServer.create(kwargs.pop("uids"), kwargs.pop("expert_cls"), kwargs.pop("hidden_dim"),
                            config=ServerConfig(device="cpu", checkpoint_dir=str(tmp_path)), **kwargs)
    assert words in str(error.value)


@pytest.mark.parametrize("saved, now", [({}, {"expansion": 4}), ({"expansion": 4, "dropout": 0.0}, {}),
                                        ({}, {"dropout": 0})])
def test_an_expert_argument_spelled_out_at_its_default_restores_the_checkpoint_written_without_it(tmp_path, saved,
                                                                                                   now):
    """The same expert either way, but the restart was refused: "expansion was None, now 4" (review 100 D6)."""
    save_checkpoint(tmp_path, cls_kwargs=saved)
    server = ExpertServer.create("ck.[0:2]", "ffn", HIDDEN, cls_kwargs=now,
                                 config=ServerConfig(device="cpu", checkpoint_dir=str(tmp_path)))
    saved_state = Checkpoints(tmp_path, {}).read()
    torch.testing.assert_close(server.backends["ck.1"].module.state_dict(),
                               saved_state["experts"]["ck.1"]["state"]["module"])
    server.checkpoints.close(save=False)


def test_an_expert_argument_changed_from_its_default_is_refused_naming_both_values(tmp_path):
    save_checkpoint(tmp_path)
    with pytest.raises(CheckpointMismatch, match="hyperparameters differ: expansion was 4, now 2"):
        ExpertServer.create("ck.[0:2]", "ffn", HIDDEN, cls_kwargs={"expansion": 2},
                            config=ServerConfig(device="cpu", checkpoint_dir=str(tmp_path)))


def test_same_experts_with_another_seed_are_restored(tmp_path):
    save_checkpoint(tmp_path)
    server = ExpertServer.create("ck.[0:2]", "ffn", HIDDEN, seed=7,
                                 config=ServerConfig(device="cpu", checkpoint_dir=str(tmp_path)))
    saved = Checkpoints(tmp_path, {}).read()
    torch.testing.assert_close(server.backends["ck.1"].module.state_dict(), saved["experts"]["ck.1"]["state"]["module"])


def test_dmoe_server_refuses_a_mismatching_checkpoint_with_an_argparse_error(tmp_path, capsys):
    save_checkpoint(tmp_path)
    output = refused_here(capsys, server_args(tmp_path, "--hidden-dim", "16"))
    assert "argument --checkpoint-dir" in output and "hidden_dim was 8, now 16" in output, output


def test_a_checkpoint_altered_by_hand_is_refused_as_corrupt_not_with_a_traceback(tmp_path, capsys):
    save_checkpoint(tmp_path)
    state = torch.load(tmp_path / FILENAME, weights_only=True)
    del state["experts"]["ck.1"]["description"]["parameters"]
    torch.save(state, tmp_path / FILENAME)
    with pytest.raises(CorruptCheckpoint, match="lacks parts"):
        save_checkpoint(tmp_path)
    output = refused_here(capsys, server_args(tmp_path))
    assert "argument --checkpoint-dir" in output and "lacks parts" in output, output


def test_damaged_checkpoint_is_refused_not_loaded(tmp_path):
    save_checkpoint(tmp_path)
    path = tmp_path / FILENAME
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # what a non-atomic writer could leave
    with pytest.raises(CorruptCheckpoint, match="cannot be read"):
        save_checkpoint(tmp_path)


def test_an_unreadable_checkpoint_is_refused_in_one_line_naming_the_file(tmp_path):
    """Review 96 D-low-3: torch's five lines of advice on weights_only came within the error, and the demo, which
    shows a server's last line, showed the advice only."""
    (tmp_path / FILENAME).write_bytes(b"garbage")
    for read in (lambda: Checkpoints(tmp_path, {}).read(), lambda: saved_uids(tmp_path)):
        with pytest.raises(CorruptCheckpoint) as error:
            read()
        assert "\n" not in str(error.value) and str(error.value).startswith(f"{tmp_path / FILENAME} cannot be read ("), \
            str(error.value)
    assert str(error.value).endswith(")")  # (saved_uids' ends with torch's first line)


# A child process that saves 64 MiB of expert state once and prints how much its peak memory grew meanwhile.
SAVE_PEAK = """
import resource, sys, torch
from dmoe.server import ExpertBackend
from dmoe.server.checkpoints import Checkpoints
module = torch.nn.Linear(4096, 4096)  # 64 MiB of weights (SGD keeps no state)
backend = ExpertBackend("big.0", module, [torch.randn(1, 4096)], torch.optim.SGD(module.parameters(), lr=0.1))
checkpoints = Checkpoints(sys.argv[1], {"big.0": backend})
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
before = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss)
checkpoints.save()
print("grew", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, flush=True)
"""


def test_a_save_needs_about_one_copy_of_the_state_in_memory_not_two(tmp_path):
    """Review 75: the snapshot was serialised into memory before it was written, so a save held twice the experts'
    state on top of them (on a 24 GB GPU's weights and Adam state, 48 GB of host memory at every checkpoint)."""
    state = 4096 * 4097 * 4
    with processes() as procs:
        procs.append(child := Proc(["-c", SAVE_PEAK, str(tmp_path)], env={"OMP_NUM_THREADS": "1"}))
        grew = int(child.wait_for(re.compile(r"grew (-?\d+)"), timeout=120).group(1))
    assert grew < 1.5 * state, f"a save grew the peak by {grew / state:.2f} times the state"


# A child process that fills every parameter with its save counter, then checkpoints, forever, printing each step.
# With "slow", fsync takes 60 s: a kill on "writing N" then lands after N's bytes went to the temp file, before the
# rename, every time.
WRITER = """
import os, sys, time, torch
from dmoe.server import ExpertBackend
from dmoe.server.checkpoints import Checkpoints
if sys.argv[3] == "slow":
    fsync = os.fsync
    os.fsync = lambda fd: (time.sleep(60), fsync(fd))
module = torch.nn.Linear(1024, 1024)  # 4 MiB per checkpoint: a write takes long enough to be killed inside
backend = ExpertBackend("big.0", module, [torch.randn(1, 1024)], torch.optim.SGD(module.parameters(), lr=0.1))
checkpoints = Checkpoints(sys.argv[1], {"big.0": backend})
i = int(sys.argv[2])  # continue numbering after the previous writer's last save
if sys.argv[3] == "slow":
    checkpoints.save = lambda save=checkpoints.save: (print(f"writing {i}", flush=True), save())
while True:
    i += 1
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(i)
    checkpoints.save()
    print(f"saved {i}", flush=True)
"""


def restored_version(directory) -> int:
    """Restores the writer's expert from ``directory``; the one value all its parameters hold."""
    module = torch.nn.Linear(1024, 1024)
    backend = ExpertBackend("big.0", module, [torch.randn(1, 1024)], torch.optim.SGD(module.parameters(), lr=0.1))
    assert Checkpoints(directory, {"big.0": backend}).restore()
    values = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).unique()
    assert len(values) == 1, "parameters from two different saves"
    assert not list(directory.glob("*.tmp")), "restore removes what a killed write left"
    return int(values.item())


def test_kill_inside_a_write_leaves_the_previous_checkpoint_and_it_is_loaded(tmp_path):
    with processes() as procs:
        # a checkpoint to fall back on, written at full speed
        procs.append(first := Proc(["-c", WRITER, str(tmp_path), "0", "fast"]))
        first.wait_for(re.compile(r"saved 1\b"), timeout=120)
        first.kill()
        version = restored_version(tmp_path)
        procs.append(writer := Proc(["-c", WRITER, str(tmp_path), str(version), "slow"]))
        writer.wait_for(re.compile(rf"writing {version + 1}\b"), timeout=120)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.05)  # the temp file appears once the snapshot is serialised
        writer.kill()
    assert list(tmp_path.glob("*.tmp")), "the kill did not land inside a write"
    assert restored_version(tmp_path) == version


def test_kills_at_random_moments_never_leave_a_half_written_checkpoint(tmp_path):
    last_version = 0
    for round_ in range(2):
        with processes() as procs:
            procs.append(writer := Proc(["-c", WRITER, str(tmp_path), str(last_version), "fast"]))
            target = last_version + 2 + round_  # kill at a different moment of the write cycle each round
            writer.wait_for(re.compile(rf"saved {target}\b"), timeout=120)
            writer.kill()
        printed = max(int(m.group(1)) for line in writer.output if (m := re.match(r"saved (\d+)", line)))
        version = restored_version(tmp_path)
        # the file holds the last save that completed (printed) or the one after it, if its rename happened
        assert printed <= version <= printed + 1 and version > last_version
        last_version = version


def in_process_backend(optimizer: str, lr: float) -> ExpertBackend:
    """An expert built as a library user (or the trainer's in-process experts) builds it: its hyperparameters do not
    name its optimizer."""
    from dmoe.experts import expert_class
    from dmoe.server.in_process import ExpertOptimizerConfig

    module = create_expert("ffn", HIDDEN, seed=0)
    return ExpertOptimizerConfig(optimizer, lr).backend("ck.0", module, tuple(expert_class("ffn").sample(2, HIDDEN)),
                                                        expert_cls="ffn")


def trained_checkpoint(directory) -> None:
    backend = in_process_backend("adam", 1e-3)
    backend.backward(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
    Checkpoints(directory, {"ck.0": backend}, interval=None).close()


def test_a_checkpoint_of_another_optimizer_is_refused_naming_the_flag_and_both_kinds(tmp_path):
    """An Adam state loaded into SGD used to restore "fine", then fail every backward with KeyError 'momentum'."""
    trained_checkpoint(tmp_path)
    checkpoints = Checkpoints(tmp_path, {"ck.0": in_process_backend("sgd", 1e-3)}, interval=None)
    with pytest.raises(CheckpointMismatch, match=r"optimizer \(--optimizer\) was 'adam', now 'sgd'"):
        checkpoints.restore()
    checkpoints.close(save=False)
    with pytest.raises(ValueError, match="saved optimizer state is 'adam''s, this expert's optimizer is 'sgd'"):
        in_process_backend("sgd", 1e-3).load_state_dict(Checkpoints(tmp_path, {}).read()["experts"]["ck.0"]["state"])


def test_a_learning_rate_changed_on_restart_is_the_one_used_and_the_change_is_logged(tmp_path, caplog):
    """The saved optimizer state carries the old learning rate, which used to replace the one given now."""
    trained_checkpoint(tmp_path)
    backend = in_process_backend("adam", 0.1)
    checkpoints = Checkpoints(tmp_path, {"ck.0": backend}, interval=None)
    with caplog.at_level("INFO", logger="dmoe.server.checkpoints"):
        assert checkpoints.restore()
    checkpoints.close(save=False)
    assert [group["lr"] for group in backend.optimizer.param_groups] == [0.1]
    assert int(next(iter(backend.optimizer.state.values()))["step"]) == 1  # the rest of the state is restored
    assert "experts now use lr 0.1 (the checkpoint was trained with 0.001)" in caplog.text


@pytest.mark.parametrize("old_description", [False, True])
def test_dmoe_servers_restarted_with_another_learning_rate_and_clipping_restore_and_use_them(
        tmp_path, caplog, old_description):
    """A restarted dmoe-server with another --lr or --clip-grad-norm was refused (both were compared with the
    checkpoint's hyperparameters, like --hidden-dim): a volunteer could not lower its learning rate without
    losing its experts' training. Checkpoints written before kept both (and not the seed) in their description."""
    save_checkpoint(tmp_path, lr=1e-3)
    if old_description:
        path = tmp_path / FILENAME
        state = torch.load(path, weights_only=True)
        for saved in state["experts"].values():
            hparams = json.loads(saved["description"]["hparams_json"])
            del hparams["seed"]
            saved["description"]["hparams_json"] = json.dumps(hparams, sort_keys=True)
        torch.save(state, path)
    with caplog.at_level("INFO", logger="dmoe.server.checkpoints"):
        server = ExpertServer.create("ck.[0:2]", "ffn", HIDDEN, lr=1e-4, clip_grad_norm=0.5,
                                     config=ServerConfig(device="cpu", checkpoint_dir=str(tmp_path)))
    backend = server.backends["ck.1"]
    assert [group["lr"] for group in backend.optimizer.param_groups] == [1e-4]
    assert backend.clip_grad_norm == 0.5
    saved = Checkpoints(tmp_path, {}).read()
    torch.testing.assert_close(backend.module.state_dict(), saved["experts"]["ck.1"]["state"]["module"])
    assert "experts now use lr 0.0001 (the checkpoint was trained with 0.001)" in caplog.text
    assert "experts now use clip_grad_norm 0.5 (the checkpoint was trained with None)" in caplog.text
    server.checkpoints.close(save=False)
    with pytest.raises(CheckpointMismatch, match="hidden_dim was 8, now 16"):  # the shape still may not change
        ExpertServer.create("ck.[0:2]", "ffn", 16, lr=1e-4,
                            config=ServerConfig(device="cpu", checkpoint_dir=str(tmp_path)))


def test_a_last_checkpoint_that_cannot_be_written_ends_the_server_in_one_line_saying_what_is_kept(tmp_path):
    """A full disk (here: a file size limit, whose writes fail as ENOSPC's do) ended dmoe-server in two tracebacks,
    158 lines whose last words were torch's zip writer's, with no word of which checkpoint survived (review 92)."""
    import resource
    import signal
    import subprocess
    import sys

    from tests.procs import ROOT

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, 20 * 1024))

    proc = subprocess.Popen([sys.executable, "-m", "dmoe.cli.server", "--experts", "ffn0.[0:2]", "--hidden-dim", "64",
                             "--device", "cpu", "--port", "0", "--checkpoint-dir", str(tmp_path / "ck")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=limit_files)
    try:
        for line in proc.stdout:  # readiness: the listening line
            if "listening on" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("dmoe-server: error: the last checkpoint could not be written to ") and \
        "File too large" in last and "none was written by this run" in last, stderr
    assert "Traceback" not in stderr, stderr


class UpThenDown(torch.nn.Module):
    """A user's expert class as first written: ``up`` declared before ``down``."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.up = torch.nn.Linear(hidden_dim, 4 * hidden_dim)
        self.down = torch.nn.Linear(4 * hidden_dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class DownThenUp(UpThenDown):
    """The same class after an ordinary refactor: the same layers (names, shapes, forward), declared the other way."""

    def __init__(self, hidden_dim: int):
        torch.nn.Module.__init__(self)
        self.down = torch.nn.Linear(4 * hidden_dim, hidden_dim)
        self.up = torch.nn.Linear(hidden_dim, 4 * hidden_dim)


def custom_backend(cls: type[torch.nn.Module]) -> ExpertBackend:
    module = cls(HIDDEN)
    return ExpertBackend("ck.0", module, [torch.randn(2, HIDDEN)], make_optimizer("adam", module.parameters(), 1e-3),
                         expert_cls="updown")


def test_a_checkpoint_of_the_same_layers_declared_in_another_order_is_refused_naming_the_order(tmp_path):
    """Review 100 D1: names and shapes were compared ignoring their order while the optimizer state is restored by
    position: each layer got the other's Adam moments, the weights went NaN and the process died of heap
    corruption at the next step."""
    first = custom_backend(UpThenDown)
    first.backward(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
    Checkpoints(tmp_path, {"ck.0": first}, interval=None).close()
    checkpoints = Checkpoints(tmp_path, {"ck.0": custom_backend(DownThenUp)}, interval=None)
    with pytest.raises(CheckpointMismatch, match=r"parameter order differs .*: the checkpoint's up\.weight, up\.bias, "
                                                 r"down\.weight, \.\.\. are requested as down\.weight"):
        checkpoints.restore()
    checkpoints.close(save=False)


def test_a_backend_refuses_optimizer_buffers_that_do_not_fit_their_parameters_before_loading_anything():
    """Review 100 D1: torch hands saved buffers to parameters by position and checks none of their shapes; the
    fused Adam kernel did not either, and corrupted the heap."""
    trained = custom_backend(UpThenDown)
    trained.backward(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
    state = trained.state_dict()
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(HIDDEN, 4 * HIDDEN)  # down's shape, given to up
    backend = custom_backend(UpThenDown)
    before = {name: tensor.clone() for name, tensor in backend.module.state_dict().items()}
    with pytest.raises(ValueError, match=r"ck\.0: optimizer state exp_avg of parameter 0 is \[8, 32\], the parameter "
                                         r"is \[32, 8\]"):
        backend.load_state_dict(state)
    torch.testing.assert_close(backend.module.state_dict(), before)
    assert not backend.optimizer.state


def trained_server_checkpoint(directory) -> None:
    server = ExpertServer.create("ck.[0:2]", "ffn", HIDDEN, config=ServerConfig(device="cpu",
                                                                                checkpoint_dir=str(directory)))
    for backend in server.backends.values():
        backend.backward(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
        backend.updates = 1
    server.checkpoints.close()


def set_key(mapping: dict, key, value) -> None:
    mapping[key] = value


# a change to expert ck.0 of a trained checkpoint, and what the refusal says of it
DAMAGES = {
    "a weight of another shape": (
        lambda e: set_key(e["state"]["module"], "ffn.0.weight", torch.zeros(16, HIDDEN)),
        "module tensor ffn.0.weight is [16, 8] float32, the expert's is [32, 8] float32"),
    "no module": (lambda e: e["state"].pop("module"), "the state holds no module tensors"),
    "hyperparameters that are no text": (lambda e: set_key(e["description"], "hparams_json", 5),
                                         "hyperparameters are not a JSON object"),
    "a NaN weight": (lambda e: e["state"]["module"]["ffn.0.weight"].fill_(float("nan")),
                     "ck.0: module ffn.0.weight is not finite"),
    "an update count that is no number": (lambda e: set_key(e, "updates", "many"), "updates is 'many', not a count"),
    "Adam moments of another shape": (
        lambda e: set_key(e["state"]["optimizer"], "state", {
            i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1)} for i in range(6)}),
        "optimizer state exp_avg of parameter 0 is [1], the parameter is [32, 8]"),
    "Adam states listed for other parameters": (
        lambda e: e["state"]["optimizer"]["param_groups"][0]["params"].reverse(),
        "optimizer state exp_avg of parameter 0 is [32, 8], the parameter its place in the groups gives it to (5) "
        "is [8]"),
    "a step count that is no whole number": (
        lambda e: [s["step"].fill_(1.5) for s in e["state"]["optimizer"]["state"].values()],
        "its optimizer's step count 1.5 is not a whole number of steps"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_that_reads_is_refused_in_one_line_not_loaded_or_ended_in_a_traceback(
        tmp_path, capsys, damage):
    """Review 100 D7: these passed the checks of the file's structure, then ended dmoe-server in a KeyError, a
    TypeError or a size mismatch, or were loaded: NaN weights served, a bad update count kept, Adam's buffers of
    another shape corrupting the heap at the first step."""
    trained_server_checkpoint(tmp_path)
    change, words = DAMAGES[damage]
    state = torch.load(tmp_path / FILENAME, weights_only=True)
    change(state["experts"]["ck.0"])
    torch.save(state, tmp_path / FILENAME)
    with pytest.raises(CorruptCheckpoint) as error:
        save_checkpoint(tmp_path)
    assert words in str(error.value) and str(tmp_path / FILENAME) in str(error.value)
    output = refused_here(capsys, server_args(tmp_path))
    assert "argument --checkpoint-dir" in output and words in output and "Traceback" not in output, output


def all_state_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for s in state["optimizer"]["state"].values() for t in s.values())


def test_an_optimizer_state_overflowed_by_a_huge_gradient_is_reset_not_saved_and_the_weights_train_again(
        tmp_path, caplog):
    """Review 111: a finite gradient of 1e20 (a server with --max-abs-value 0 and no --clip-grad-norm) overflowed
    Adam's average of squared gradients to +inf: those weights never moved again, the checkpoint saved it, and the
    restart refused the whole file, every expert's weights."""
    config = ServerConfig(device="cpu", checkpoint_dir=str(tmp_path), checkpoint_interval=3600, max_abs_value=0)
    server = ExpertServer.create("ck.[0:2]", "ffn", HIDDEN, optimizer="adam", config=config)
    poisoned, honest = server.backends["ck.0"], server.backends["ck.1"]
    honest.backward(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
    poisoned.backward(torch.randn(8, HIDDEN), torch.full((8, HIDDEN), 1e20))
    assert poisoned.updates == 1 and not all_state_finite(poisoned.state_dict())  # (the step was taken)
    server.checkpoints.close()  # the final checkpoint
    assert "ck.0: the optimizer state of" in caplog.text and "reset, the weights kept" in caplog.text
    saved = torch.load(tmp_path / FILENAME, weights_only=True)
    assert all(all_state_finite(saved["experts"][uid]["state"]) for uid in ("ck.0", "ck.1"))
    restarted = ExpertServer.create("ck.[0:2]", "ffn", HIDDEN, optimizer="adam", config=config)
    try:
        for uid in ("ck.0", "ck.1"):
            torch.testing.assert_close(restarted.backends[uid].module.state_dict(),
                                       server.backends[uid].module.state_dict())
        before = [p.detach().clone() for p in restarted.backends["ck.0"].module.parameters()]
        restarted.backends["ck.0"].backward(torch.randn(3, HIDDEN), torch.randn(3, HIDDEN))
        assert all((p != q).any() for p, q in zip(restarted.backends["ck.0"].module.parameters(), before))
    finally:
        restarted.checkpoints.close(save=False)


def test_a_checkpoint_with_an_overflowed_optimizer_buffer_restores_the_weights_and_resets_that_state(tmp_path,
                                                                                                     caplog):
    """Review 111: what servers before the fix saved was refused whole ("altered by hand, or damaged?"); the weights
    are good, only the parameter's optimizer state is lost."""
    trained_server_checkpoint(tmp_path)
    state = torch.load(tmp_path / FILENAME, weights_only=True)
    buffers = state["experts"]["ck.0"]["state"]["optimizer"]["state"]
    next(iter(buffers.values()))["exp_avg_sq"].fill_(float("inf"))
    torch.save(state, tmp_path / FILENAME)
    server = ExpertServer.create("ck.[0:2]", "ffn", HIDDEN, config=ServerConfig(device="cpu",
                                                                                checkpoint_dir=str(tmp_path)))
    try:
        for uid in ("ck.0", "ck.1"):
            torch.testing.assert_close(server.backends[uid].module.state_dict(), state["experts"][uid]["state"]["module"])
        assert all_state_finite(server.backends["ck.0"].state_dict()) and sum(map(bool, server.backends["ck.0"].optimizer.state.values())) \
            == len(buffers) - 1  # (the reset parameter's state is built at its next step)
        assert "ck.0: the optimizer state of ffn.0.weight was not finite" in caplog.text
    finally:
        server.checkpoints.close(save=False)
