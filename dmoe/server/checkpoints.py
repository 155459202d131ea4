"""Checkpoints of a server's experts: parameters, optimizer and scheduler state, saved often and atomically.

One file per server (``DIR/experts.pt``) rather than one per expert: a single ``os.replace`` then publishes a
snapshot of every expert taken at one instant, so a restarted server never mixes experts from different moments,
and a directory can be checked against the experts requested in one read. The snapshot is copied to host memory
while holding the runtime's compute lock (no optimizer step can run halfway through it) and written afterwards,
so compute only pauses for the copy, not for the disk.

A write goes to a temporary file in the same directory, is fsynced, renamed over the old checkpoint, and the
directory is fsynced: a crash at any moment leaves either the old checkpoint or the new one, never half of one.

One server at a time: :class:`Checkpoints` holds an exclusive lock on ``DIR/.lock`` (:func:`lock_directory`) from
its first restore, save or start to its ``close()``, so a second server given the same directory is refused instead
of writing its experts over the first one's (and removing the first one's temp files as stale). Reading needs none.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, ContextManager, Iterator, Mapping

import torch

from dmoe.experts import expert_class
from dmoe.locking import InUse, lock_file
from dmoe.server.backend import ExpertBackend, optimizer_name, saved_optimizer_name
from dmoe.server.optimizer_state import MAX_UPDATES, whole_steps

logger = logging.getLogger(__name__)

FORMAT = "dmoe-experts-checkpoint"
VERSION = 1
FILENAME = "experts.pt"
TMP_SUFFIX = ".tmp"
LOCK_FILENAME = ".lock"


class CheckpointMismatch(ValueError):
    """The checkpoint in the directory was saved for other experts than the ones this server was asked to host."""


class CheckpointNotWritten(RuntimeError):
    """The last checkpoint could not be written (a full disk): what is lost, in one line (the program's last)."""


def _first_os_error(error: BaseException) -> BaseException:
    """The OSError under ``error`` (a full disk's, under torch's follow-on zip-writer error), else ``error``."""
    seen, current = set(), error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return error


class CorruptCheckpoint(ValueError):
    """The checkpoint file exists but cannot be read (not written by dmoe, or damaged on disk)."""


class CheckpointDirectoryInUse(InUse):
    """Another process (a server) holds the checkpoint directory."""


def _first_line(error: Exception) -> str:
    """The error's type and the first line of its message: torch's unpickling errors run to five lines of advice on
    ``weights_only``, which buried the file's name and what to do in a one-line error (review 96 D-low-3)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def lock_directory(directory: str | os.PathLike, holder_kind: str = "server") -> IO[str] | None:
    """Takes the exclusive lock on ``directory/.lock`` (created, with the directory, if missing) and returns the
    open lock file, which holds it until closed (or the process ends, however it ends). Raises
    CheckpointDirectoryInUse naming the holder's pid (and what it is: ``holder_kind``, the kind of program that
    locks such a directory). None where the platform has no ``flock``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return lock_file(directory / LOCK_FILENAME, str(directory), holder_kind,
                     f"give each {holder_kind} its own directory", CheckpointDirectoryInUse)


def saved_uids(directory: str | os.PathLike) -> list[str] | None:
    """The uids of the experts checkpointed in ``directory`` (sorted), None if it holds no checkpoint; raises
    CorruptCheckpoint. Maps the file instead of reading its tensors."""
    path = Path(directory) / FILENAME
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CorruptCheckpoint(f"{path} cannot be read ({_first_line(error)})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or not isinstance(state.get("experts"), dict):
        raise CorruptCheckpoint(f"{path} is not a dmoe experts checkpoint")
    return sorted(state["experts"])


#: what :func:`describe` says of an expert
DESCRIBED = ("expert_cls", "hparams_json", "inputs", "outputs", "parameters")


#: hyperparameters a restart may change: the seed only chose the initial weights, which the checkpoint replaces;
#: the learning rate and clipping are training settings, applied from now on (a restarted volunteer lowering its
#: learning rate was refused)
MAY_CHANGE = frozenset({"seed", "lr", "clip_grad_norm"})


def describe(backend: ExpertBackend) -> dict[str, Any]:
    """What must be equal between a checkpoint and a server for the checkpoint to be loaded into it."""
    return {
        "expert_cls": backend.expert_cls,
        "hparams_json": json.dumps(backend.hparams, sort_keys=True, default=str),
        "inputs": [[list(s.shape), s.dtype] for s in backend.inputs_schema],
        "outputs": [[list(s.shape), s.dtype] for s in backend.outputs_schema],
        "parameters": {name: list(t.shape) for name, t in backend.module.state_dict().items()},
    }


def optimizer_steps(optimizer_state: dict[str, Any] | None) -> int:
    """The steps an optimizer's state says it took (Adam counts them per parameter; the most of them), 0 when it
    keeps no count (SGD): the update count of checkpoints written before backends counted their updates."""
    steps = [value.get("step") for value in ((optimizer_state or {}).get("state") or {}).values()]
    return max((int(step) for step in steps if step is not None), default=0)


def to_host(value: Any) -> Any:
    """A deep copy with every tensor cloned to CPU memory: later optimizer steps cannot change it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


def _fsync_directory(directory: Path) -> None:
    """Makes a rename in ``directory`` durable where the platform can; a failure only costs that durability (the
    file is written and renamed), so it is logged, not raised."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError as error:
        logger.warning("could not fsync %s after a rename in it (%s): a power loss could undo the rename", directory,
                       error)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes | Callable[[IO[bytes]], None]) -> None:
    """Temp file in the same directory, fsync, rename over ``path``, fsync the directory. ``data``: the bytes, or
    what writes them into the file (``torch.save`` of a snapshot, which then needs no second copy in memory)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as file:
            if callable(data):
                data(file)
            else:
                file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


class Checkpoints:
    """Saves ``backends`` to ``directory`` every ``interval`` seconds from a thread it owns, and once on ``close()``.

    Args:
        directory: created if missing; holds ``experts.pt`` (and, only while a write is in progress, a temp file).
        backends: uid -> backend, the experts of one server.
        pause: entered while the state is copied (the runtime's :meth:`~dmoe.server.runtime.Runtime.paused`): no
            batch runs meanwhile, so a snapshot never sees half of an optimizer step. None when nothing computes
            concurrently.
        interval: seconds between periodic saves; None or 0 saves only on ``close()``.
        serving: the server's live uid -> backend table (:attr:`ExpertServer.backends`). The checkpoint keeps the
            uids of ``backends`` (a restart with the same flags must find them), and saves for each the backend
            serving it now: a uid the server stopped serving and later adopted back (a standby's cell) is served by
            a new backend, and saving the one built first wrote the dropped, stale copy (review 59). A uid no longer
            served keeps the backend it had.
    """

    def __init__(self, directory: str | os.PathLike, backends: Mapping[str, ExpertBackend], *,
                 pause: Callable[[], ContextManager[Any]] | None = None, interval: float | None = 60.0,
                 serving: Mapping[str, ExpertBackend] | None = None):
        self.directory = Path(directory)
        self.path = self.directory / FILENAME
        self.backends = dict(backends)
        self.serving = serving
        self.pause = pause
        self.interval = interval
        self.saves = 0
        self.last_saved: float | None = None  # time.time() of the last snapshot written
        self._stop = threading.Event()
        self._save_lock = threading.Lock()  # the timer thread and close() never write at the same time
        self._thread: threading.Thread | None = None
        self._lock_file: IO[str] | None = None  # held from the first restore/save/start to close()
        self.directory.mkdir(parents=True, exist_ok=True)

    def _hold(self) -> None:
        """Takes the directory's lock before this object first writes or removes anything in it (reading needs
        none): raises CheckpointDirectoryInUse."""
        if self._lock_file is None:
            self._lock_file = lock_directory(self.directory)

    # ---- restoring ----
    def read(self) -> dict[str, Any] | None:
        """The checkpoint's contents (on CPU), or None when there is none yet; raises CorruptCheckpoint."""
        if not self.path.exists():
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CorruptCheckpoint(f"{self.path} cannot be read ({_first_line(error)}); move it away "
                                    "to start these experts from scratch") from None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CorruptCheckpoint(f"{self.path} is not a dmoe experts checkpoint")
        if state.get("version") != VERSION:
            raise CorruptCheckpoint(f"{self.path} has format version {state.get('version')}, "
                                    f"this dmoe reads version {VERSION}")
        experts = state.get("experts")
        if not (isinstance(experts, dict) and isinstance(state.get("pattern"), str)
                and isinstance(state.get("saved_at"), (int, float))
                and all(isinstance(e, dict) and isinstance(e.get("state"), dict)
                        and isinstance(e.get("description"), dict)
                        and all(key in e["description"] for key in DESCRIBED) for e in experts.values())):
            raise CorruptCheckpoint(f"{self.path} lacks parts of a dmoe experts checkpoint (altered by hand?)")
        for uid, saved in experts.items():
            unsound = _unsound(saved)
            if unsound is not None:  # (they ended the server in a traceback, or were loaded: review 100 D7)
                raise CorruptCheckpoint(f"{self.path} is not a sound dmoe experts checkpoint (altered by hand?): "
                                        f"expert {uid}'s {unsound}; move it away to start these experts from scratch")
        return state

    def check(self, state: dict[str, Any]) -> None:
        """Raises CheckpointMismatch naming every difference between the checkpoint and the requested experts."""
        saved = state["experts"]
        missing = sorted(set(self.backends) - set(saved))
        extra = sorted(set(saved) - set(self.backends))
        problems = []
        if missing or extra:
            problems.append(f"uids differ: the checkpoint holds {state['pattern']}, this server asks for "
                            f"{_pattern(self.backends)}"
                            + (f"; not in the checkpoint: {_some(missing)}" if missing else "")
                            + (f"; only in the checkpoint: {_some(extra)}" if extra else ""))
        shared = sorted(set(saved) & set(self.backends))
        by_difference: dict[str, list[str]] = {}  # the same change usually applies to every expert: say it once
        for uid in shared:
            want, have = (with_default_arguments(d) for d in (describe(self.backends[uid]), saved[uid]["description"]))
            for key in DESCRIBED:
                if _compared(key, want[key]) != _compared(key, have[key]):
                    by_difference.setdefault(_difference(key, have[key], want[key]), []).append(uid)
            # the optimizer's kind, where the hyperparameters do not say it (backends built outside dmoe-server):
            # another kind's state would fail every backward with a KeyError
            saved_kind = saved_optimizer_name(saved[uid]["state"].get("optimizer"))
            kind = optimizer_name(self.backends[uid].optimizer)
            if saved_kind is not None and kind is not None and saved_kind != kind and \
                    "optimizer" not in json.loads(have["hparams_json"]):
                by_difference.setdefault(f"optimizer (--optimizer) was {saved_kind!r}, now {kind!r}", []).append(uid)
        for difference, uids in by_difference.items():
            who = f"all {len(uids)} experts" if len(uids) == len(shared) else _some(uids)
            problems.append(f"{difference} ({who})")
        if problems:
            raise CheckpointMismatch(f"checkpoint {self.path} does not match the experts requested: "
                                     + "; ".join(problems))

    def restore(self) -> bool:
        """Loads every expert from the checkpoint if there is one (True), after checking that it matches."""
        self._hold()
        self._remove_stale_temp_files()
        state = self.read()
        if state is None:
            logger.info("no checkpoint in %s yet: experts start from their initial weights", self.directory)
            return False
        self.check(state)
        for uid, backend in self.backends.items():  # all of them before any is loaded
            self._check_state(uid, backend, state["experts"][uid]["state"])
        changed: dict[str, tuple[Any, Any]] = {}
        for uid, backend in self.backends.items():
            saved = state["experts"][uid]
            device = next((p.device for p in backend.module.parameters()), torch.device("cpu"))
            try:
                loaded = backend.load_state_dict(_to_device(saved["state"], device))
            except (MemoryError, torch.cuda.OutOfMemoryError):
                raise
            except Exception as error:  # a state the checks let through: still the file's fault, in one line
                raise CorruptCheckpoint(f"{self.path}: expert {uid} cannot be loaded from it ({type(error).__name__}: "
                                        f"{error}); move it away to start these experts from scratch") from error
            for key, values in loaded.items():
                changed.setdefault(key, values)
            was = json.loads(saved["description"]["hparams_json"])
            if "clip_grad_norm" in was and "clip_grad_norm" in backend.hparams and \
                    was["clip_grad_norm"] != backend.hparams["clip_grad_norm"]:
                changed.setdefault("clip_grad_norm", (was["clip_grad_norm"], backend.hparams["clip_grad_norm"]))
            backend.reset_nonfinite_optimizer_state()
            backend.forward_calls = saved.get("forward_calls", 0)
            backend.backward_calls = saved.get("backward_calls", 0)
            backend.updates = saved.get("updates", optimizer_steps(saved["state"].get("optimizer")))
        logger.info("restored %d experts from %s (saved %.1f s ago)", len(self.backends), self.path,
                    time.time() - state["saved_at"])
        for key, (was, now) in changed.items():  # the optimizers keep the settings given now
            logger.info("the experts now use %s %s (the checkpoint was trained with %s)", key, now, was)
        return True

    def _check_state(self, uid: str, backend: ExpertBackend, state: dict[str, Any]) -> None:
        """Raises CorruptCheckpoint unless ``backend`` can load ``state`` (:meth:`ExpertBackend.check_state`: the
        tensors the description promised, optimizer buffers that fit their parameters) and every number in it is
        finite, a whole count of steps where it counts them: a weight altered or damaged to NaN was served, a buffer
        of another shape corrupted the heap at the first step (review 100 D1, D7)."""
        def corrupt(reason: str) -> CorruptCheckpoint:
            return CorruptCheckpoint(f"{self.path} does not hold what its description says (altered by hand, or "
                                     f"damaged?): {reason}; move it away to start these experts from scratch")

        try:
            steps = backend.check_state(state)
        except ValueError as error:
            raise corrupt(str(error)) from None
        # (exact, one tensor at a time: all_finite's sums may overflow where no element is infinite). An optimizer's
        # per-parameter buffer may be: an overflow in training (review 111) that servers before it saved; the restore
        # resets it (ExpertBackend.reset_nonfinite_optimizer_state) rather than refuse every expert's weights
        name = next((name for name, tensor in _floating_tensors(state) if not torch.isfinite(tensor).all()
                     and not _optimizer_buffer(name)), None)
        if name is not None:
            raise corrupt(f"{uid}: {name} is not finite")
        bad = next((step for step in steps if whole_steps(step.item()) is None), None)
        if bad is not None:
            raise corrupt(f"{uid}: its optimizer's step count {bad.item()!r} is not a whole number of steps")

    def _remove_stale_temp_files(self) -> None:
        # a temp file is left behind only by a process killed mid-write: it is never read, only removed
        for stale in self.directory.glob(f"{FILENAME}.*{TMP_SUFFIX}"):
            logger.info("removing %s, left by a write that did not finish", stale)
            stale.unlink(missing_ok=True)

    def trade(self, uid: str, new_uid: str, backend: ExpertBackend) -> None:
        """Keeps ``new_uid`` (saved from ``backend``, or the backend serving it then) in place of ``uid``: a cell
        that ``--num-experts`` chose, found owned by another key once declared, traded for a free one (review 92
        D1: kept, every restart resumed the cell that no client reached)."""
        with self._save_lock:
            self.backends.pop(uid, None)
            self.backends[new_uid] = backend

    # ---- saving ----
    def current(self) -> dict[str, ExpertBackend]:
        """uid -> the backend saved for it: the one serving it now, else the one it had (see ``serving``)."""
        if self.serving is None:
            return dict(self.backends)
        for uid, backend in self.backends.items():
            now = self.serving.get(uid)
            if now is not None and now is not backend:
                self.backends[uid] = now  # kept if it stops being served again
        return dict(self.backends)

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of every expert's state in host memory."""
        experts = {}
        with self.pause() if self.pause is not None else contextlib.nullcontext():
            for uid, backend in self.current().items():
                backend.reset_nonfinite_optimizer_state()  # never saved over the last good file (review 111)
                experts[uid] = {"state": to_host(backend.state_dict()), "description": describe(backend),
                                "forward_calls": backend.forward_calls, "backward_calls": backend.backward_calls,
                                "updates": backend.updates}
        return {"format": FORMAT, "version": VERSION, "saved_at": time.time(), "pattern": _pattern(self.backends),
                "experts": experts}

    def save(self) -> Path:
        """Takes a snapshot and writes it atomically; returns the checkpoint's path."""
        with self._save_lock:
            self._hold()
            state = self.snapshot()
            # straight into the file: serialised into memory first, a save held twice the experts' state in host
            # memory on top of them (48 GB for a 24 GB GPU's weights and Adam state: review 75)
            write_atomically(self.path, lambda file: torch.save(state, file))
            self.saves += 1
            self.last_saved = state["saved_at"]
        logger.debug("checkpoint %d written to %s", self.saves, self.path)
        return self.path

    def start(self) -> "Checkpoints":
        """Starts periodic saving (nothing to start when ``interval`` is None or 0)."""
        self._hold()
        if self.interval and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dmoe-checkpoints", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.save()
            except Exception as error:  # a full disk must not stop the server; the next period tries again
                logger.error("could not write the checkpoint to %s: %s (%s)", self.path, _first_os_error(error),
                             self._kept())
                logger.debug("the checkpoint's failure", exc_info=True)

    def _kept(self) -> str:
        """What the checkpoint file holds, as the saves left it."""
        if self.last_saved is None:
            return "none was written by this run"
        return f"it holds the experts as of {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.last_saved))}"

    def close(self, save: bool = True) -> None:
        """Stops the timer thread, then (by default) writes a last checkpoint, then lets go of the directory."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if save:
                try:
                    self.save()
                except Exception as error:
                    # one line for the program to end with: a full disk ended a server in two tracebacks of 158
                    # lines whose last words were torch's zip writer's (review 92)
                    raise CheckpointNotWritten(f"the last checkpoint could not be written to {self.path}: "
                                               f"{_first_os_error(error)} ({self._kept()})") from error
                logger.info("final checkpoint written to %s", self.path)
        finally:
            with self._save_lock:
                if self._lock_file is not None:
                    self._lock_file.close()
                    self._lock_file = None


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _optimizer_buffer(name: str) -> bool:
    """Whether ``name`` (:func:`_floating_tensors`') is an optimizer's per-parameter buffer (``exp_avg_sq``, ...),
    not its step count."""
    parts = name.split()
    return len(parts) == 4 and parts[:2] == ["optimizer", "state"] and parts[3] != "step"


def _floating_tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(where, tensor) for each floating-point tensor in a state, e.g. ``module ffn.0.weight``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _floating_tensors(item, f"{path} {key}".strip())
    elif isinstance(value, (list, tuple)):
        for at, item in enumerate(value):
            yield from _floating_tensors(item, f"{path} {at}".strip())


#: counters a checkpoint keeps per expert beside its state (missing in old ones)
COUNTERS = ("forward_calls", "backward_calls", "updates")


def _unsound(saved: dict[str, Any]) -> str | None:
    """What of a checkpointed expert's description or counters could not have been written by :meth:`snapshot`, or
    None: a hyperparameter text that is not a JSON object ended the server in a TypeError, a count of updates that is
    no number was loaded as it was (review 100 D7)."""
    description = saved["description"]
    try:
        hparams = json.loads(description["hparams_json"])
    except (TypeError, ValueError):
        hparams = None
    if not isinstance(hparams, dict):
        return f"hyperparameters are not a JSON object: {str(description['hparams_json'])[:40]!r}"
    parameters = description["parameters"]
    if not isinstance(description["expert_cls"], str) or not isinstance(parameters, dict) or not all(
            isinstance(name, str) and isinstance(shape, list) and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
            for name, shape in parameters.items()):
        return "description names no class or no parameter shapes"
    for counter in COUNTERS:
        count = saved.get(counter, 0)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_UPDATES:
            return f"{counter} is {str(count)[:40]!r}, not a count"
    return None


def _some(uids: list[str], limit: int = 5) -> str:
    return ", ".join(uids[:limit]) + (f" and {len(uids) - limit} more" if len(uids) > limit else "")


def _pattern(backends: Mapping[str, ExpertBackend]) -> str:
    uids = sorted(backends)
    return f"1 expert {uids[0]}" if len(uids) == 1 else f"{len(uids)} experts {uids[0]} .. {uids[-1]}"


def fixed_hparams(hparams_json: str) -> dict[str, Any]:
    """The hyperparameters that must match for saved experts to be loaded: those not in :data:`MAY_CHANGE`
    (checkpoints written before kept the learning rate and clipping in their description, not the seed). Raises
    ValueError for JSON that is not an object."""
    hparams = json.loads(hparams_json)
    if not isinstance(hparams, dict):
        raise ValueError("the hyperparameters are not a JSON object")
    return {name: setting for name, setting in hparams.items() if name not in MAY_CHANGE}


def with_default_arguments(description: dict[str, Any]) -> dict[str, Any]:
    """``description`` (:func:`describe`'s) with its hyperparameters completed by the defaults of its class's
    constructor: an argument spelled out at its default builds the same expert as one left out, yet a restart with
    ``--expert-kwargs '{"expansion": 4}'`` was refused against a checkpoint written without it ("expansion was None,
    now 4", review 100 D6). Arguments given are kept as given (what the checkpoint and ``info`` say); as it is for a
    class not registered here, a constructor without a signature, or hyperparameters that are not a JSON object."""
    try:
        hparams = json.loads(description["hparams_json"])
        parameters = list(inspect.signature(expert_class(description["expert_cls"]).cls).parameters.values())
    except (KeyError, TypeError, ValueError):  # (json's and inspect's errors are ValueErrors)
        return description
    if not isinstance(hparams, dict):
        return description
    defaults = {}
    for parameter in parameters[1:]:  # (the first is hidden_dim, always given)
        if parameter.default is inspect.Parameter.empty or parameter.name in hparams or parameter.kind not in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            continue
        try:  # as JSON has it: a tuple default then equals the list a given one was saved as
            defaults[parameter.name] = json.loads(json.dumps(parameter.default, default=str, allow_nan=False))
        except ValueError:  # (nan, which equals nothing: left out, as before)
            continue
    if not defaults:
        return description
    return {**description, "hparams_json": json.dumps({**defaults, **hparams}, sort_keys=True, default=str)}


def _compared(key: str, value: Any) -> Any:
    """A description's part as compared (see :func:`fixed_hparams`). The parameters in their order: the optimizer's
    state is restored by position, so a class whose layers were declared in another order (same names, same shapes)
    got each layer's Adam moments on another layer, NaN weights and a corrupted heap (review 100 D1)."""
    if key == "parameters":
        return list(value.items())
    return fixed_hparams(value) if key == "hparams_json" else value


def _difference(key: str, saved: Any, wanted: Any) -> str:
    if key == "parameters":
        changed = [f"{name} {saved.get(name, 'absent')} -> {wanted.get(name, 'absent')}"
                   for name in sorted(set(saved) | set(wanted)) if saved.get(name) != wanted.get(name)]
        if not changed:  # the same tensors, in another order
            first = next(at for at, (old, new) in enumerate(zip(saved, wanted)) if old != new)
            return (f"parameter order differs (the optimizer state is restored by position): the checkpoint's "
                    f"{', '.join(list(saved)[first:first + 3])}, ... are requested as "
                    f"{', '.join(list(wanted)[first:first + 3])}, ...")
        return "parameter shapes differ (checkpoint -> requested): " + ", ".join(changed[:4]) + (
            f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    if key == "hparams_json":
        old, new = _compared(key, saved), _compared(key, wanted)
        changed = [f"{name} was {old.get(name)!r}, now {new.get(name)!r}"
                   for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
        return "hyperparameters differ: " + ", ".join(changed)
    label = {"expert_cls": "expert class", "inputs": "input schema", "outputs": "output schema"}[key]
    return f"{label} was {saved!r}, now {wanted!r}"
