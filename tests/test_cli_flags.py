"""The programs' flags (review 72): durations capped at a year, devices this torch cannot use, flags given where
they do nothing, repeatable flags of a config file, a monitor's --host that cannot be bound, and a trainer stopped
by SIGTERM or SIGHUP before its loop."""
from __future__ import annotations

import argparse
import errno
import re
import signal
from pathlib import Path

import pytest
import torch

from dmoe.cli import demo
from dmoe.cli import dht as dht_program
from dmoe.cli import monitor as monitor_program
from dmoe.cli import server as run_server
from dmoe.cli import train
from dmoe.cli.config import MAX_SECONDS, MAX_THREADS, duration, parse_args, parse_given
from dmoe.directory.__main__ import parse_directory_args
from dmoe.server.server import check_device
from tests.procs import running

SERVER = ["--experts", "ffn0.[0:2]", "--hidden-dim", "8"]


def usage_error(call, argv, capsys) -> str:
    """The one line ``call(argv)`` ended with as it exited with a usage error (status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        call(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.rstrip("\n").split("\n")[-1]


# ---- sizes ---------------------------------------------------------------------------------------------------------

def test_parameter_bytes_counted_on_the_meta_device_are_those_of_the_module_built_for_real():
    """(review 100 D8) Counted without memory or initialisation: what a size flag is checked against."""
    from dmoe.cli.sizes import parameter_bytes
    from dmoe.experts import create_expert
    from dmoe.trainer.model import GatedTransformerLM, ModelConfig

    builds = [lambda: GatedTransformerLM(ModelConfig(hidden=48, n_heads=2, seq_len=20), lambda i: torch.nn.Identity()),
              lambda: create_expert("transformer", 16), lambda: create_expert("ffn", 8, expansion=3),
              lambda: torch.nn.Linear(3, 5).half()]
    for build in builds:
        assert parameter_bytes(build) == sum(p.numel() * p.element_size() for p in build().parameters())
    assert parameter_bytes(lambda: torch.nn.Linear(2**40, 2**20, bias=False)) == 2**62  # (4 EiB: nothing taken)
    ones = torch.ones(2)
    ones.add_(1)  # in-place operations outside its build still run
    assert ones.tolist() == [2.0, 2.0]


# ---- durations ---------------------------------------------------------------------------------------------------

def test_a_duration_is_positive_finite_and_at_most_a_year_in_its_unit():
    assert duration()("1.5") == 1.5 and duration(zero=True)("0") == 0.0
    assert duration("min")(str(MAX_SECONDS / 60)) == MAX_SECONDS / 60
    assert duration("ms", zero=True)(str(MAX_SECONDS * 1000)) == MAX_SECONDS * 1000
    for parse, text, says in ((duration(), "0", "must be positive"), (duration(zero=True), "-1", "must be >= 0"),
                              (duration(), "inf", "must be finite"), (duration(), "nan", "must be positive"),
                              (duration(), "1e10", "at most 31536000 seconds (a year)"),
                              (duration("min"), "1e9", "at most 525600 minutes (a year)"),
                              (duration("ms", zero=True), "1e12", "at most 31536000000 ms (a year)")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            parse(text)
    # Python's waits overflow past about 9.2e9 s: the cap is well below it
    assert MAX_SECONDS < 9e9


def time_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The flags of ``parser`` that take one float and whose name or help speaks of a time."""
    words = re.compile(r"\b(seconds?|minutes?|ms|timeout|interval|period|ttl|grace|latency|expiration|stagger|"
                       r"hedge)\b", re.IGNORECASE)
    flags = []
    for action in parser._actions:
        kind = getattr(action.type, "__name__", "")
        takes_float = isinstance(action.default, float) or "float" in kind or "duration" in kind
        about_time = words.search(f"{action.dest.replace('_', ' ')} {action.help or ''}")
        if action.option_strings and action.nargs is None and takes_float and about_time:
            flags.append(action.option_strings[0])
    return flags


def test_every_time_flag_of_every_program_refuses_a_duration_beyond_a_year(capsys):
    """Review 72: --forward-timeout 1e10 lost every expert (the wait overflowed), --checkpoint-interval 1e10 the
    checkpoint thread, in a traceback."""
    programs = [
        (run_server.build_parser(), run_server.main, SERVER),
        (train.build_parser(), train.parse_config, ["--experts", "remote", "--initial-peers", "127.0.0.1:1",
                                                    "--collaborate", "run", "--target-batch-size", "8"]),
        (dht_program.build_parser(), dht_program.parse_args, []),
        (monitor_program.build_parser(), monitor_program.main, ["--initial-peers", "127.0.0.1:1"]),
    ]
    for parser, call, base in programs:
        flags = time_flags(parser)
        assert flags, parser.prog
        for flag in flags:
            line = usage_error(call, [*base, flag, "1e15"], capsys)  # beyond a year in any unit
            assert f"argument {flag}:" in line, (parser.prog, flag, line)
    for flag in ("--forward-timeout", "--backward-timeout", "--timeout-after-k-min", "--matchmaking-time",
                 "--allreduce-timeout", "--refresh-period", "--progress-ttl", "--max-minutes"):
        assert flag in time_flags(train.build_parser()), flag
    for flag in ("--checkpoint-interval", "--replica-interval", "--shutdown-grace", "--max-stream-seconds",
                 "--adoption-stagger", "--refresh-period", "--expiration", "--inject-latency-ms"):
        assert flag in time_flags(run_server.build_parser()), flag
    for flag in ("--refresh-period", "--expiration"):
        line = usage_error(parse_directory_args, ["--declare", "ffn0.0", "--endpoint", "127.0.0.1:1", flag, "1e10"],
                           capsys)
        assert f"argument {flag}: must be at most 31536000 seconds" in line, line
    assert train.parse_config(["--max-minutes", "525600"]).max_minutes == 525600  # a year, in minutes


@pytest.mark.parametrize("value, says", [("inf", "must be finite"), ("-1", "must be >= 0"),
                                         ("1e12", "must be at most 31536000000 ms")])
def test_an_infinite_or_absurd_injected_latency_is_refused(value, says, capsys):
    """--inject-latency-ms inf was accepted, and the server then answered no call."""
    line = usage_error(run_server.main, [*SERVER, "--inject-latency-ms", value], capsys)
    assert line.startswith(f"dmoe-server: error: argument --inject-latency-ms: {says}"), line


# ---- devices -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device, says", [
    ("meta", "meta tensors hold no data"),
    ("mps", "this torch build cannot allocate on mps"),
    ("xpu", "this torch build cannot allocate on xpu"),
])
def test_a_device_this_torch_cannot_use_is_a_usage_error_naming_the_flag(device, says, capsys):
    """Review 72: a traceback once the model or the experts were moved to it."""
    if device != "meta":
        try:
            torch.empty(1, device=device)
            pytest.skip(f"this torch can allocate on {device}")
        except Exception:  # noqa: BLE001 - what this torch raises is what the check must catch
            pass
    line = usage_error(run_server.main, [*SERVER, "--device", device], capsys)
    assert line.startswith(f"dmoe-server: error: argument --device: {says}"), line
    line = usage_error(train.parse_config, ["--device", device], capsys)
    assert line.startswith(f"dmoe-train: error: --device {device}: {says}"), line


def test_a_cuda_index_beyond_the_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device(torch.device("cuda"))
    check_device(torch.device("cuda:1"))
    with pytest.raises(ValueError, match=re.escape("cuda:2 was asked for but torch sees 2 CUDA devices (cuda:0 to "
                                                   "cuda:1)")):
        check_device(torch.device("cuda:2"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cuda was asked for but torch sees no CUDA device"):
        check_device(torch.device("cuda:0"))
    check_device(torch.device("cpu"))


# ---- flags given -------------------------------------------------------------------------------------------------

def test_parse_given_names_the_flags_of_the_command_line_and_the_config_file_not_the_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('hidden-dim = 16\nreplicas = 2\n')
    parser = run_server.build_parser()
    args, given = parse_given(parser, ["--config", str(path), "--experts", "a.0", "--lr=0.001", "--checkpoint-int",
                                       "60", "--no-shared-memory"])
    assert given == {"hidden_dim", "replicas", "experts", "lr", "checkpoint_interval", "shared_memory"}
    assert (args.hidden_dim, args.lr, args.checkpoint_interval, args.shared_memory) == (16, 0.001, 60.0, False)
    assert args.max_batch_size == 4096 and not hasattr(args, "config")
    assert {a.dest: a.default for a in parser._actions}["lr"] == 1e-3  # the parser's defaults are given back
    _, given = parse_given(run_server.build_parser(), ["--experts", "a.0"])
    assert given == {"experts"}


@pytest.mark.parametrize("flags, says", [
    # the defaults typed out: the flag does nothing all the same (review 72: these were accepted)
    (["--checkpoint-interval", "60"], "argument --checkpoint-interval: needs --checkpoint-dir"),
    (["--replicas", "2"], "argument --replicas: needs --replica-dir"),
    (["--replica-interval", "60"], "argument --replica-interval: needs --replica-dir"),
    (["--adoption-stagger", "2"], "argument --adoption-stagger: needs --replica-dir"),
    (["--metrics-host", "0.0.0.0"], "argument --metrics-host: needs --metrics-port"),
    (["--fault-seed", "7"], "argument --fault-seed: needs an injected fault"),
    (["--fault-seed", "7", "--inject-latency-ms", "0"], "argument --fault-seed: needs an injected fault"),
    (["--latency-jitter", "none"], "argument --latency-jitter: needs --inject-latency-ms > 0"),
    (["--overlap-copies", "--device", "cpu"], "argument --overlap-copies: needs a CUDA device, and this server "
                                              "computes on cpu"),
    (["--process-restarts", "9"], "argument --process-restarts: needs --processes N above 1"),
    (["--process-restarts", "3", "--processes", "1"], "argument --process-restarts: needs --processes N above 1"),
])
def test_a_server_flag_given_where_it_does_nothing_is_refused_naming_what_it_needs(flags, says, capsys):
    line = usage_error(run_server.main, [*SERVER, *flags], capsys)
    assert line.startswith(f"dmoe-server: error: {says}"), line


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--replica-dir", "--identity"])
def test_an_empty_server_path_is_refused_naming_the_flag(flag, capsys):
    """``--checkpoint-dir ''`` (an unset shell variable) wrote into the current directory, under a new key at every
    restart (review 92)."""
    line = usage_error(run_server.main, [*SERVER, flag, ""], capsys)
    assert line == f"dmoe-server: error: argument {flag}: must name a directory or file (leave it out for none)", line


@pytest.mark.parametrize("flag", ["--torch-threads", "--workers"])
def test_an_absurd_server_thread_count_is_refused_naming_the_flag_as_dmoe_train_s_threads_is(flag, capsys):
    """--torch-threads 100000 died of a segmentation fault with no word, --workers 100000 grew the server to 21k
    threads and then a traceback (review 100 D4)."""
    parser = run_server.build_parser()
    for count in (MAX_THREADS + 1, 100000):
        args, given = parse_given(parser, [*SERVER, flag, str(count)])
        line = usage_error(lambda _: run_server.check_args(args, parser, given), None, capsys)
        assert line.startswith(f"dmoe-server: error: argument {flag} {count} is absurd (at most {MAX_THREADS};"), line
    args, given = parse_given(parser, [*SERVER, flag, str(MAX_THREADS)])
    assert run_server.check_args(args, parser, given) == ["ffn0.0", "ffn0.1"]


def test_either_way_of_naming_the_experts_on_the_command_line_overrides_the_other_in_the_config_file(tmp_path):
    """A command-line flag overrides the file's key, but the file's ``num-experts`` made ``--experts`` a usage
    error ("give either"), and the file's ``experts`` made ``--num-experts`` one (review 92)."""
    chosen = tmp_path / "chosen.toml"
    chosen.write_text('num-experts = 2\ngrid = [4, 4]\nlayer = ["ffn0"]\n')
    named = tmp_path / "named.toml"
    named.write_text('experts = "ffn0.[0:2]"\n')
    parser = run_server.build_parser()
    args, given = parse_given(parser, ["--config", str(chosen), "--experts", "a.[0:3]"],
                              alternatives=run_server.EXPERT_CHOICES)
    assert (args.experts, args.num_experts, args.grid, args.layer) == ("a.[0:3]", None, None, None)
    assert run_server.expert_uids(args, parser) == ["a.0", "a.1", "a.2"] and "num_experts" not in given
    parser = run_server.build_parser()
    args, _ = parse_given(parser, ["--config", str(named), "--num-experts", "1", "--grid", "2", "--layer", "x"],
                          alternatives=run_server.EXPERT_CHOICES)
    assert (args.experts, args.num_experts) == (None, 1) and run_server.expert_uids(args, parser) is None
    parser = run_server.build_parser()  # the file alone, and a flag of its own side, as before
    args, _ = parse_given(parser, ["--config", str(chosen), "--num-experts", "3"],
                          alternatives=run_server.EXPERT_CHOICES)
    assert (args.num_experts, args.grid, args.layer) == (3, [4, 4], ["ffn0"])


def test_a_server_flag_in_the_config_file_counts_as_given(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("replicas = 2\n")
    line = usage_error(run_server.main, [*SERVER, "--config", str(path)], capsys)
    assert line == "dmoe-server: error: argument --replicas: needs --replica-dir", line


def test_server_flags_with_what_they_need_pass_the_checks():
    parser = run_server.build_parser()
    for flags in (["--fault-seed", "7", "--fail-rate", "0.1"], ["--metrics-port", "0", "--metrics-host", "127.0.0.1"],
                  ["--processes", "2", "--process-restarts", "1"], ["--checkpoint-dir", "x", "--checkpoint-interval",
                                                                     "60"],
                  ["--replica-dir", "x", "--replicas", "2"], ["--no-overlap-copies", "--device", "cpu"]):
        args, given = parse_given(parser, [*SERVER, *flags])
        assert run_server.check_args(args, parser, given) == ["ffn0.0", "ffn0.1"], flags


REMOTE = ["--experts", "remote", "--initial-peers", "127.0.0.1:1"]


@pytest.mark.parametrize("flags, says", [
    (["--target-batch-size", "4096"], "--target-batch-size is only used with --collaborate RUN_ID"),
    (["--averaging-port", "5000"], "--averaging-port is only used with --collaborate"),
    (["--wait-for-trainers", "3"], "--wait-for-trainers is only used with --collaborate"),
    (["--matchmaking-time", "5"], "--matchmaking-time is only used with --collaborate"),  # (the default)
    (["--averaging-client-mode"], "--averaging-client-mode is only used with --collaborate"),
    ([*REMOTE, "--refresh-period", "2"], "--refresh-period is only used with --collaborate"),
    (["--forward-timeout", "0.001"], "--forward-timeout is only used with --experts remote"),
    (["--k-min", "2"], "--k-min is only used with --experts remote"),
    (["--no-allow-zero-outputs"], "--allow-zero-outputs is only used with --experts remote"),
    (["--max-abs-value", "1e6"], "--max-abs-value is only used with --experts remote"),
    (["--balance-coef", "9"], "--balance-coef is only used with --switch"),
])
def test_a_trainer_flag_given_where_it_does_nothing_is_refused_naming_what_it_needs(flags, says, capsys):
    """Review 72: all of these were accepted and ignored, the run ending with status 0."""
    line = usage_error(train.parse_config, flags, capsys)
    assert line.startswith("dmoe-train: error: ") and says in line, line


def test_trainer_flags_with_their_mode_pass(tmp_path):
    collab = [*REMOTE, "--collaborate", "run", "--target-batch-size", "64", "--wait-for-trainers", "2",
              "--matchmaking-time", "3"]
    assert train.parse_config(collab).matchmaking_time == 3
    assert train.parse_config([*REMOTE, "--forward-timeout", "3", "--k-min", "2"]).k_min == 2
    assert train.parse_config(["--switch", "--k-best", "1", "--balance-coef", "0.5"]).balance_coef == 0.5
    path = tmp_path / "c.toml"
    path.write_text("forward-timeout = 3\n")
    with pytest.raises(SystemExit):  # a key of the file counts as given
        train.parse_config(["--config", str(path)])
    assert train.parse_config(["--config", str(path), *REMOTE]).forward_timeout == 3


def test_the_demo_sets_the_modes_its_flags_need_and_passes_its_trainers_no_flag_they_refuse(tmp_path):
    """The demo sets --experts remote itself (and --collaborate with --trainers N): a remote expert's or a
    collaboration's flag given to it is not refused, and each trainer's flags parse."""
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be " * 200)
    for trainers in (1, 3):
        rest = ["--data", str(text), "--out-dir", str(tmp_path / "out"), "--forward-timeout", "3",
                *(["--matchmaking-time", "3", "--averaging-port", "45300"] if trainers > 1 else [])]
        config = train.parse_config(rest, defaults=demo.demo_defaults(trainers), prog=demo.PROG,
                                    settle=demo.demo_settings(trainers))
        assert config.forward_timeout == 3
        if trainers > 1:
            trainer_args = demo.collaborative_args(rest, config, trainers)
            for i in range(trainers):
                assert train.parse_config(trainer_args(i, "127.0.0.1:5000")).data_shard == i


# ---- repeatable flags and the config file ------------------------------------------------------------------------

def test_a_repeatable_flag_on_the_command_line_replaces_the_config_files_list(tmp_path):
    """Review 72: the lists were merged, so a broken --custom-module of the file could not be replaced."""
    path = tmp_path / "c.toml"
    path.write_text('custom-module = ["old_a.py", "old_b.py"]\n')
    parser = run_server.build_parser()
    assert parse_args(parser, ["--config", str(path)]).custom_module == ["old_a.py", "old_b.py"]
    args = parse_args(run_server.build_parser(), ["--config", str(path), "--custom-module", "new.py",
                                                  "--custom-module", "newer.py"])
    assert args.custom_module == ["new.py", "newer.py"]
    assert parse_args(run_server.build_parser(), ["--custom-module", "x.py"]).custom_module == ["x.py"]
    assert parse_args(run_server.build_parser(), []).custom_module == []


def test_a_custom_module_given_replaces_a_broken_one_of_the_config_file(tmp_path, capsys):
    broken, good = tmp_path / "broken.py", tmp_path / "good_experts.py"
    broken.write_text("raise ImportError('broken on purpose')\n")
    good.write_text("X = 1\n")
    path = tmp_path / "c.toml"
    path.write_text(f'custom-module = "{broken}"\n')
    parser = run_server.build_parser()
    args, given = parse_given(parser, ["--config", str(path), *SERVER, "--custom-module", str(good)])
    assert run_server.check_args(args, parser, given) == ["ffn0.0", "ffn0.1"]


# ---- dmoe-monitor's --host ---------------------------------------------------------------------------------------

class RecordedMonitor:
    """Stands in for the monitor's SwarmMonitor (which starts a DHT node and joins): records that one was built."""

    built: list[tuple] = []

    def __init__(self, *args, **kwargs):
        self.built.append(args)

    def close(self):
        pass


@pytest.mark.parametrize("error, flag", [(OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), "--host"),
                                         (OSError(errno.EADDRINUSE, "Address already in use"), "--port")])
def test_the_monitor_names_the_host_or_the_port_that_cannot_be_bound(error, flag, monkeypatch, capsys):
    """Review 72: a --host not of this machine was blamed on --port."""
    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(RecordedMonitor, "built", [])
    monkeypatch.setattr(monitor_program, "SwarmMonitor", RecordedMonitor)
    monkeypatch.setattr(monitor_program, "MonitorServer", refuse)
    line = usage_error(monitor_program.main, ["--initial-peers", "127.0.0.1:1", "--host", "10.255.255.1"], capsys)
    assert line.startswith(f"dmoe-monitor: error: argument {flag}: cannot listen on 10.255.255.1:0: "), line
    assert not RecordedMonitor.built


@pytest.mark.parametrize("flag", ["--host", "--port"])
def test_the_monitor_refuses_a_host_of_another_machine_or_a_port_in_use_before_it_joins_the_dht(flag, monkeypatch,
                                                                                                capsys):
    """Review 112 D5: the monitor started its DHT node and joined (with unreachable --initial-peers: waited for the
    join's timeout, then named only those) before it found it could not listen where told."""
    import socket

    monkeypatch.setattr(RecordedMonitor, "built", [])
    monkeypatch.setattr(monitor_program, "SwarmMonitor", RecordedMonitor)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        where = ["--host", "192.0.2.1"] if flag == "--host" else ["--port", str(port)]
        line = usage_error(monitor_program.main, ["--initial-peers", "127.0.0.1:1", *where], capsys)
    shown = "192.0.2.1:0" if flag == "--host" else f"127.0.0.1:{port}"
    assert line.startswith(f"dmoe-monitor: error: argument {flag}: cannot listen on {shown}"), line
    assert not RecordedMonitor.built, "the monitor joined the DHT before it checked where it listens"


# ---- a trainer stopped before its loop ---------------------------------------------------------------------------

def test_a_trainer_stopped_by_sigterm_or_sighup_while_it_waits_for_the_others_exits_130(tmp_path):
    """Review 72: SIGTERM or SIGHUP before the loop (joining, downloading the state, --wait-for-trainers) killed the
    trainer with status 143 or 129, saying nothing and closing nothing; Ctrl-C there exits 130."""
    text = tmp_path / "t.txt"
    text.write_text("the king queen sword crown night love death speak lord\n" * 300)
    with running("-m", "dmoe.dht", "--port", "0") as dht:
        peer = dht.endpoint()
        for signum in (signal.SIGTERM, signal.SIGHUP):
            flags = ["-m", "dmoe.cli.train", "--data", str(text), "--experts", "remote", "--initial-peers", peer,
                     "--seq-len", "16", "--hidden", "16", "--heads", "2", "--layers", "1", "--grid", "2", "2",
                     "--k-best", "2", "--threads", "1", "--collaborate", f"stopped-{signum}",
                     "--target-batch-size", "8", "--wait-for-trainers", "2",
                     "--out-dir", str(tmp_path / f"run-{signum}")]
            with running(*flags, env={"TQDM_DISABLE": "1"}) as trainer:
                trainer.wait_for("waiting for 2 trainers", timeout=120)
                trainer.popen.send_signal(signum)
                assert trainer.popen.wait(60) == 130
                trainer._reader.join(timeout=10)
                output = "".join(trainer.output)
                assert "dmoe-train: interrupted before training began" in output, output
                assert "Traceback" not in output, output
    assert not list(Path(tmp_path).glob("run-*/checkpoint.pt"))  # nothing trained, nothing written
