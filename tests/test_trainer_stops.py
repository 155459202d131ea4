"""How a trainer stops and what it saves when it does (review 90): a closed terminal or output pipe, a second stop
signal while a collaboration waits for its round, an error in a step, an in-process expert gone infinite, and a
signal landing while the loop's progress bar closes.

The first ones run ``dmoe-train`` as a program (its output is what breaks); the others run the loop in this process
with the stand-in mixture layers of ``tests/test_trainer.py``.
"""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dmoe.cli import train as train_program
from dmoe.cli.signals import InterruptingSignals
from dmoe.client.gating import NoAliveExpertsError, TooFewGradients
from dmoe.collab import CollaborativeOptimizer
from dmoe.trainer import loop as trainer
from dmoe.trainer.loop import ExpertsFailed, train
from tests.procs import running
from tests.test_trainer import (StandInMixture, inside_optimizer_steps, local_config, text_file,  # noqa: F401
                                tiny)

ROOT = Path(__file__).parents[1]


def program_flags(text_file: Path, out_dir: Path, steps: int) -> list[str]:
    """dmoe-train with in-process experts, tiny, a validation line every 2 steps and no periodic checkpoint."""
    return ["--data", str(text_file), "--out-dir", str(out_dir), "--seq-len", "16", "--hidden", "32", "--layers", "1",
            "--heads", "2", "--grid", "2", "2", "--k-best", "2", "--batch-size", "4", "--steps", str(steps),
            "--eval-interval", "2", "--eval-batches", "1", "--checkpoint-interval", "100000", "--sample-bytes", "0",
            "--threads", "1"]


def program_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def read_until(fd: int, pattern: bytes, timeout: float = 120.0) -> bytes:
    """What ``fd`` gives until ``pattern`` is in it (fails after ``timeout`` seconds, or at the end of it)."""
    seen, deadline = b"", time.monotonic() + timeout
    while pattern not in seen:
        assert time.monotonic() < deadline, f"no {pattern!r} in time; read: {seen[-2000:]!r}"
        if select.select([fd], [], [], 1.0)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # (a pty whose other end closed: EIO)
                chunk = b""
            assert chunk, f"the output ended without {pattern!r}: {seen[-2000:]!r}"
            seen += chunk
    return seen


def checkpoint_step(out_dir: Path) -> int | None:
    path = out_dir / "checkpoint.pt"
    return torch.load(path, weights_only=True)["step"] if path.exists() else None


def test_a_closed_terminal_stops_dmoe_train_with_its_checkpoint_saved(text_file, tmp_path):
    """The terminal (an SSH session) closes: SIGHUP, then every write to it fails with EIO. The trainer said
    "interrupted at step N: saving the checkpoint" to it before saving, died of the failed write (status 1) and
    wrote no checkpoint, though the README promises that SIGHUP saves."""
    out_dir, errors = tmp_path / "run", tmp_path / "stderr"
    args = [sys.executable, "-m", "dmoe.cli.train", *program_flags(text_file, out_dir, 100000)]
    env = program_env()
    pid, terminal = pty.fork()  # the child's controlling terminal is the pty: closing it hangs it up
    if pid == 0:
        try:
            fd = os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # stderr kept, to read the trainer's words
            os.dup2(fd, 2)
            os.chdir(ROOT)
            os.execve(args[0], args, env)
        finally:
            os._exit(127)
    status = None
    try:
        read_until(terminal, b"step 4: validation loss")
        os.close(terminal)
        terminal = None
        deadline = time.monotonic() + 60
        while status is None and time.monotonic() < deadline:
            done, raw = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if done else None
            time.sleep(0.1)
    finally:
        if terminal is not None:
            os.close(terminal)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    said = errors.read_text()
    assert status == 130, f"exit status {status}; stderr: {said[-2000:]}"
    assert "SIGHUP: stopping after the step in flight" in said and "Error" not in said, said[-2000:]
    step = checkpoint_step(out_dir)
    assert step is not None and step >= 4, "no checkpoint of the steps before the terminal closed"


@pytest.mark.parametrize("stop", [None, signal.SIGTERM], ids=["runs on", "then SIGTERM"])
def test_a_closed_output_pipe_neither_ends_the_run_nor_keeps_it_from_saving(text_file, tmp_path, stop):
    """``dmoe-train ... | head -1`` (the reader goes), or ``| tee train.log`` and a Ctrl-C that stops tee too: the
    next line the trainer wrote (a validation line, or "interrupted at step N" before saving) raised EPIPE, and
    dmoe-train ended with status 1 and no checkpoint. Now it stops writing to it and goes on: to its last step, or
    to the stop's save and status 130."""
    out_dir, errors = tmp_path / "run", tmp_path / "stderr"
    steps = 100000 if stop else 12
    with open(errors, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "dmoe.cli.train", *program_flags(text_file, out_dir, steps)],
                                stdout=subprocess.PIPE, stderr=stderr, env=program_env(), cwd=ROOT)
    try:
        read_until(proc.stdout.fileno(), b"step 2: validation loss")
        proc.stdout.close()  # the reader is gone
        if stop is not None:
            proc.send_signal(stop)
        status = proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = errors.read_text()
    assert status == (130 if stop else 0), f"exit status {status}; stderr: {said[-2000:]}"
    assert "Broken pipe" not in said, said[-2000:]
    step = checkpoint_step(out_dir)
    assert step == 12 if stop is None else (step is not None and step >= 2), f"checkpoint at step {step}"


def failing_factory(config, error: BaseException, at_call: int):
    """Stand-in layers; the first one raises ``error`` in its ``at_call``-th forward (its first ``eval_batches``
    calls are the validation at step 0, then one per step)."""
    def make(i: int):
        layer = StandInMixture(config.hidden, config.grid, f"ffn{i}", config.k_best)
        if i == 0:
            forward = layer.forward

            def failing(x):
                if layer.calls + 1 == at_call:
                    layer.calls += 1
                    raise error
                return forward(x)

            layer.forward = failing
        return layer
    return make


NO_ANSWER = ("64 of 64 rows got no answer from any expert of 'ffn0'; pass allow_zero_outputs=True to use zeros for "
             "them instead")  # what a mixture layer with allow_zero_outputs=False raises (dmoe.client.gating)


def test_dmoe_train_whose_experts_fail_saves_the_last_complete_step_and_names_the_flag(text_file, tmp_path,
                                                                                       monkeypatch, capsys):
    """--no-allow-zero-outputs and the swarm's only server dies: the step's NoAliveExpertsError ended dmoe-train in
    a traceback naming the Python argument, and every step since the last checkpoint was lost."""
    def factory(config, resources, dht=None):
        return failing_factory(config, NoAliveExpertsError(NO_ANSWER), config.eval_batches + 8)

    monkeypatch.setattr(trainer, "make_moe_factory", factory)
    out_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        train_program.main(program_flags(text_file, out_dir, 20) + ["--eval-interval", "100"])
    assert str(exited.value.code) == (
        "dmoe-train: the experts failed after step 7 (--no-allow-zero-outputs): 64 of 64 rows got no answer from any "
        "expert of 'ffn0'; --allow-zero-outputs uses zeros for them instead; the checkpoint holds step 7")
    assert checkpoint_step(out_dir) == 7


CPU_OUT_OF_MEMORY = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                     "tried to allocate 24000000000 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("error", [RuntimeError(CPU_OUT_OF_MEMORY + "\nframe #0: c10::Error::Error"),
                                   torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 22.35 GiB.")],
                         ids=["cpu", "cuda"])
def test_dmoe_train_out_of_memory_in_a_step_saves_it_and_names_the_batch_flags(text_file, tmp_path, monkeypatch,
                                                                               capsys, error):
    """A --batch-size (or --seq-len) too large for the memory ended dmoe-train in a 12-frame traceback naming no flag
    (review 108 D2): one line now, after the last complete step is saved as before."""
    monkeypatch.setattr(trainer, "make_moe_factory",
                        lambda config, resources, dht=None: failing_factory(config, error, config.eval_batches + 3))
    out_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        train_program.main(program_flags(text_file, out_dir, 20) + ["--eval-interval", "100"])
    first = str(error).splitlines()[0]
    assert str(exited.value.code) == (
        "dmoe-train: out of memory on --device cpu with --batch-size 4 x --seq-len 16 (attention grows with the square "
        f"of --seq-len): give a smaller --batch-size or --seq-len ({type(error).__name__}: {first})")
    assert checkpoint_step(out_dir) == 2
    assert "the checkpoint holds step 2" in capsys.readouterr().out


def test_an_error_other_than_out_of_memory_in_a_step_still_ends_dmoe_train_in_its_traceback(text_file, tmp_path,
                                                                                            monkeypatch):
    """(a bug is to be seen where it is)"""
    error = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    monkeypatch.setattr(trainer, "make_moe_factory",
                        lambda config, resources, dht=None: failing_factory(config, error, config.eval_batches + 3))
    with pytest.raises(RuntimeError) as raised:
        train_program.main(program_flags(text_file, tmp_path / "run", 20) + ["--eval-interval", "100"])
    assert raised.value is error


@pytest.mark.parametrize("error, raised", [
    (TooFewGradients("3 rows got fewer than backward_k_min=2 expert gradients in 'ffn0'"),
     "the experts failed after step 7 (--backward-k-min): 3 rows got fewer than --backward-k-min 2 expert gradients "
     "in 'ffn0'; the checkpoint holds step 7"),
    (RuntimeError("CUDA out of memory"), "CUDA out of memory"),
], ids=["backward-k-min", "out of memory"])
def test_an_error_in_a_step_saves_the_last_complete_step_before_it_ends_the_run(text_file, tmp_path, error, raised):
    config = tiny(text_file, tmp_path, steps=20, eval_interval=100, checkpoint_interval=1000)
    with pytest.raises((ExpertsFailed, RuntimeError)) as failed:
        train(config, failing_factory(config, error, config.eval_batches + 8))
    assert str(failed.value) == raised
    assert (failed.value is error) == (type(error) is RuntimeError)  # any other error: itself, with its traceback
    assert checkpoint_step(tmp_path / "run") == 7


def test_an_error_that_cut_a_steps_update_leaves_the_checkpoint_as_it_was(text_file, tmp_path, capsys):
    """In-process experts step in backward: an error after one of them stepped leaves parts of two steps."""
    client_steps = 0

    def fail_after_an_expert_stepped_in_step_5(optimizer):
        nonlocal client_steps
        client_steps += type(optimizer) is torch.optim.AdamW
        if client_steps == 4 and type(optimizer) is torch.optim.Adam:
            raise RuntimeError("out of memory")

    with inside_optimizer_steps(fail_after_an_expert_stepped_in_step_5), pytest.raises(RuntimeError):
        train(local_config(text_file, tmp_path, "run", checkpoint_interval=2))
    assert "RuntimeError in the middle of step 5: the checkpoint is left as it was (step 4)" in capsys.readouterr().out
    assert checkpoint_step(tmp_path / "run" / "run") == 4


def test_no_checkpoint_is_written_while_an_in_process_expert_is_not_finite(text_file, tmp_path, capsys):
    """An --expert-lr whose first Adam step overflows: the experts' weights are infinite (their gradients were
    finite), and save() checked only the client's parameters, so "the last good checkpoint" held them."""
    result = train(local_config(text_file, tmp_path, "run", steps=2, checkpoint_interval=1, expert_lr=1e39))
    assert result["step"] == 2
    assert "warning: the model's weights are not finite at step 1: the checkpoint is left as it was (none written)" \
        in capsys.readouterr().out
    assert not (tmp_path / "run" / "run" / "checkpoint.pt").exists()


class Killed(Exception):
    """What the default action of SIGTERM would do to the test process."""


def test_a_stop_signal_while_the_progress_bar_closes_still_saves_the_last_step(text_file, tmp_path, monkeypatch):
    """The loop's deferral ended before the bar closed (a terminal write), and a signal there left train() with a
    KeyboardInterrupt before the final save: dmoe-train said it stopped "after its last checkpoint", steps ago."""
    class Bar(trainer.tqdm):
        fired = False

        def close(self):
            if not Bar.fired and self.n == self.total:
                Bar.fired = True
                signal.raise_signal(signal.SIGTERM)  # lands during the close
            super().close()

    monkeypatch.setattr(trainer, "tqdm", Bar)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(Killed()))
    try:
        config = tiny(text_file, tmp_path, steps=15, eval_interval=100, checkpoint_interval=10)
        with InterruptingSignals():  # as dmoe-train's main() runs it
            try:
                result = train(config, trainer_factory(config))
            except KeyboardInterrupt:  # (which would end pytest)
                pytest.fail("the signal left train() as a KeyboardInterrupt, before the final save")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert Bar.fired and result["interrupted"] and result["step"] == 15
    assert checkpoint_step(tmp_path / "run") == 15


def trainer_factory(config):
    return lambda i: StandInMixture(config.hidden, config.grid, f"ffn{i}", config.k_best)


@pytest.fixture(scope="module")
def bootstrap():
    with running("-m", "dmoe.dht", "--log-level", "WARNING") as proc:
        yield proc.endpoint()


@pytest.mark.parametrize("where, saved", [("waiting for the round", 5), ("in the update", 3),
                                          ("publishing the update", 6)])
def test_a_second_signal_in_a_collaborations_step_keeps_every_complete_step(text_file, tmp_path, bootstrap,
                                                                             monkeypatch, capsys, where, saved):
    """A collaboration's step is mostly waiting (for the others' reports, matchmaking, the all-reduce) and changes
    the parameters only in its update. The whole call counted as the update: a second Ctrl-C while step 6 waited
    left the checkpoint at step 3 though step 5 was complete (--checkpoint-interval 3). Only a cut update, which
    leaves parts of two steps, keeps the checkpoint as it was; an update done before the signal is counted."""
    if where == "waiting for the round":
        real = CollaborativeOptimizer._global_step

        def interrupted(self, state):
            if self.local_step == 5:
                raise KeyboardInterrupt  # what a second Ctrl-C does in the waits
            return real(self, state)

        monkeypatch.setattr(CollaborativeOptimizer, "_global_step", interrupted)
    elif where == "publishing the update":
        real_reset = CollaborativeOptimizer._reset

        def interrupted(self):
            if self.local_step == 6:
                raise KeyboardInterrupt
            return real_reset(self)

        monkeypatch.setattr(CollaborativeOptimizer, "_reset", interrupted)
    config = tiny(text_file, tmp_path, experts="remote", initial_peers=(bootstrap,), collaborate=f"stops{saved}",
                  target_batch_size=16, batch_size=16, layers=1, steps=20, eval_interval=100, checkpoint_interval=3,
                  refresh_period=0.2)
    client_steps = 0

    def cut_the_sixth_update(optimizer):
        nonlocal client_steps
        client_steps += 1
        if client_steps == 6:
            raise KeyboardInterrupt

    if where == "in the update":
        with inside_optimizer_steps(cut_the_sixth_update):
            result = train(config, trainer_factory(config))
    else:
        result = train(config, trainer_factory(config))
    assert result["interrupted"] and checkpoint_step(tmp_path / "run") == saved
    out = capsys.readouterr().out
    if saved == 3:
        assert "interrupted in the middle of step 6: the checkpoint is left as it was (step 3)" in out
    else:
        assert re.search(rf"interrupted at step {saved}: checkpoint written", out), out
