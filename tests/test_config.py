"""Config files for dmoe programs, choosing experts by count on a grid, and the programs' flag errors."""
from __future__ import annotations

import asyncio
import functools
import random
import signal
import socket
import time

import pytest

from dmoe.averaging import AveragerConfig
from dmoe.cli import dht as dht_program
from dmoe.cli import monitor as monitor_program
from dmoe.cli import server as run_server
from dmoe.cli import train
from dmoe.cli.config import default_shown, parse_args
from dmoe.collab import CollaborationConfig
from dmoe.directory import alive_experts, choose_experts
from tests.procs import running



def usage_error(main, argv, capsys) -> str:
    """What a program's ``main(argv)`` wrote to stderr as it exited with a usage error (status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err

def write(tmp_path, text: str):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return str(path)


def test_server_config_file_sets_flags_with_dashes_or_underscores_and_flags_override_it(tmp_path):
    path = write(tmp_path, """
experts = "ffn0.[0:2].[0:2]"
hidden-dim = 16
initial_peers = ["127.0.0.1:1234"]
expert-kwargs = { }
reject-nonfinite = false
lr = 1
optimizer = "sgd"
""")
    args = parse_args(run_server.build_parser(), ["--config", path, "--lr", "0.5", "--hidden-dim", "32"])
    assert args.experts == "ffn0.[0:2].[0:2]"      # required flag, given by the file
    assert args.initial_peers == ["127.0.0.1:1234"] and args.optimizer == "sgd"
    assert args.reject_nonfinite is False and args.expert_kwargs == {}
    assert args.lr == 0.5 and args.hidden_dim == 32   # the command line wins
    assert not hasattr(args, "config")


@pytest.mark.parametrize("text, named, allowed", [
    ("hiden_dim = 3", "'hiden_dim'", "allowed keys:"),
    ("hidden_dim = -3", "'hidden_dim'", "must be positive, got -3"),
    ("hidden-dim = 'wide'", "'hidden-dim'", "expected positive int"),
    ('optimizer = "lion"', "'optimizer'", "adam, sgd"),
    ("reject_nonfinite = 3", "'reject_nonfinite'", "true or false"),
    ("port = [1, 2]", "'port'", "a single value"),
    ("experts =", "not valid TOML", "line 1"),
    ("hidden-dim = 8\nhidden_dim = 16", "'hidden-dim' and 'hidden_dim'", "set the same flag"),
    # a date inside a table: the error's own message failed (review 49: a TypeError traceback)
    ("expert-kwargs = { when = 1979-05-27 }", "'expert-kwargs'", "expected a table of JSON values"),
    ("experts = { when = 1979-05-27 }", "'experts'", "expected a single value"),
])
def test_bad_config_keys_and_values_fail_with_one_line_naming_the_key(tmp_path, capsys, text, named, allowed):
    path = write(tmp_path, text + "\n")
    err = usage_error(run_server.main, ["--config", path], capsys)
    assert err.count("\n") == 1 and err.startswith(f"dmoe-server: error: config {path}: ")
    assert named in err and allowed in err


def test_missing_config_file_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_server.main(["--config", str(tmp_path / "nope.toml")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read it" in err


@pytest.mark.parametrize("main", [run_server.main, train.parse_config, dht_program.main, monitor_program.main],
                         ids=["server", "train", "dht", "monitor"])
@pytest.mark.parametrize("content, where", [
    ('experts = "ffn0.0.0"\n# r\xe9seau du labo\n'.encode("latin-1"), "byte 0xe9 on line 2: invalid continuation byte"),
    ('experts = "ffn0.0.0"\n'.encode("utf-16"), "byte 0xff on line 1: invalid start byte"),  # Notepad's "Unicode"
], ids=["latin-1", "utf-16"])
def test_a_config_file_that_is_not_utf8_is_one_line_naming_the_file(tmp_path, capsys, main, content, where):
    """Every program ended in a UnicodeDecodeError traceback (review 100 D5)."""
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    err = usage_error(main, ["--config", str(path)], capsys)
    assert err.count("\n") == 1 and err.endswith(f": error: config {path}: not UTF-8 text (a TOML file must be "
                                                  f"UTF-8): {where}\n"), err


def test_trainer_config_file_with_tuples_and_booleans(tmp_path, capsys):
    path = write(tmp_path, 'steps = 5\ngrid = [2, 2]\nresume = true\nexperts = "remote"\n'
                           'initial-peers = ["1.2.3.4:5"]\n')
    config = train.parse_config(["--config", path, "--steps", "7"])
    assert (config.steps, config.grid, config.resume, config.initial_peers) == (7, (2, 2), True, ("1.2.3.4:5",))
    with pytest.raises(SystemExit):
        train.parse_config(["--config", write(tmp_path, "grid = [2, 0]\n")])
    assert "key 'grid': must be positive" in capsys.readouterr().err


def test_a_collaborating_trainer_with_remote_peers_must_be_reachable_by_them(capsys):
    """Its averager would be announced at 127.0.0.1 to trainers on other machines: every round would fail on it."""
    remote = ["--experts", "remote", "--initial-peers", "10.1.2.3:31337", "--collaborate", "run",
              "--target-batch-size", "64"]
    with pytest.raises(SystemExit):
        train.parse_config(remote)
    assert "--averaging-host 127.0.0.1 cannot be reached by trainers on other machines" in capsys.readouterr().err
    assert train.parse_config(remote + ["--averaging-host", "10.1.2.4"]).averaging_host == "10.1.2.4"
    assert train.parse_config(remote + ["--averaging-client-mode"]).averaging_client_mode
    behind_nat = train.parse_config(remote + ["--averaging-host", "0.0.0.0",
                                              "--averaging-announce-host", "203.0.113.9"])
    settings = behind_nat.collaboration_settings()
    assert settings["announce_host"] == settings["state_announce_host"] == "203.0.113.9"
    local = ["--experts", "remote", "--initial-peers", "127.0.0.1:31337", "--collaborate", "run",
             "--target-batch-size", "64"]
    assert train.parse_config(local).averaging_host == "127.0.0.1"


@pytest.mark.parametrize("flags, named", [
    (["--num-experts", "4", "--layer", "ffn0"], "--grid"),
    (["--num-experts", "4", "--grid", "2", "2"], "--layer"),
    (["--num-experts", "5", "--grid", "2", "2", "--layer", "ffn0"], "--num-experts"),
    (["--num-experts", "2", "--grid", "2", "2", "--layer", "ffn.0"], "--layer"),
    (["--experts", "ffn.0", "--num-experts", "2"], "--experts"),
    (["--experts", "ffn.0", "--grid", "2"], "--grid"),
    (["--experts", "ffn.0", "--metrics-port", "-1"], "--metrics-port"),
    (["--experts", "ffn.0", "--log-level", "chatty"], "--log-level"),
    (["--experts", "ffn.0", "--initial-peers", "nowhere"], "--initial-peers"),
])
def test_server_rejects_bad_placement_and_operator_flags_naming_them(flags, named, capsys):
    assert named in usage_error(run_server.main, flags, capsys)


SERVER = ["--experts", "ffn.0", "--hidden-dim", "8", "--device", "cpu", "--log-level", "WARNING"]


def one_error_line(err: str) -> str:
    """The error line of a usage error, checked to be the last line and no traceback."""
    assert "Traceback" not in err, err
    *_, line = err.rstrip("\n").split("\n")
    assert line.startswith("dmoe-server: error: argument --"), err
    return line


@pytest.mark.parametrize("flags, words", [
    # inf went through to an int() where it was used (OverflowError), or trained the weights into inf
    (["--max-queued-mb", "inf"], "argument --max-queued-mb: must be finite, got inf"),
    (["--activation-cache-mb", "inf"], "argument --activation-cache-mb: must be finite, got inf"),
    (["--replica-dir", "unused", "--replica-budget-mb", "inf"], "argument --replica-budget-mb: must be finite"),
    (["--lr", "inf"], "argument --lr: must be finite, got inf"),
    (["--max-abs-value", "inf"], "argument --max-abs-value: must be finite, got inf"),
    (["--lr", "nan"], "argument --lr: must be positive, got nan"),
    # gRPC takes its limits as C ints
    (["--max-message-bytes", str(2**31)], "argument --max-message-bytes: must be at most 2147483647, got 2147483648"),
    # no DHT node would store these as the experts' endpoint: found once the experts were built and the port bound
    (["--announce-host", "my host"], "argument --announce-host: 'my host' cannot be announced"),
    (["--announce-host", 'x"y'], "argument --announce-host: 'x\"y' cannot be announced"),
    (["--announce-host", "h" * 91], "of at most 96 bytes"),
])
def test_server_flag_values_that_failed_with_a_traceback_are_refused_at_once(flags, words, capsys):
    assert words in one_error_line(usage_error(run_server.main, [*SERVER, *flags], capsys))


def test_the_largest_values_those_checks_allow_pass_them():
    parser = run_server.build_parser()
    args = parser.parse_args([*SERVER, "--max-message-bytes", str(2**31 - 1), "--announce-host", "h" * 90])
    assert run_server.check_args(args, parser) == ["ffn.0"]
    args = parser.parse_args([*SERVER, "--announce-host", "2001:db8::1"])  # announced as [2001:db8::1]:PORT
    assert run_server.check_args(args, parser) == ["ffn.0"]


@pytest.mark.parametrize("host, words", [
    ("203.0.113.5:8000", "'203.0.113.5:8000' is HOST:PORT: give the host alone"),
    ("example.org:8000", "is HOST:PORT"),
    ("[2001:db8::1]:8000", "is HOST:PORT"),
    ("http://example.org", "is no host"),
    ("[2001:db8::1", "is no host"),
    ("2001:db8::1]", "is no host"),
    ("unix", "is no host"),  # unix:PORT is a unix socket to gRPC
])
def test_an_announce_host_that_is_no_host_is_refused_naming_the_flag(host, words, capsys):
    """Review 99 D5: each was announced as is, [203.0.113.5:8000]:PORT for one, and the server's experts were
    reached by nobody. In every program that announces: the server, the trainer, and the configs behind them."""
    parser = run_server.build_parser()
    with pytest.raises(SystemExit):  # (not main: before, it served)
        run_server.check_args(parser.parse_args([*SERVER, "--announce-host", host]), parser)
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("dmoe-server: error: argument --announce-host: ") and words in line, line
    collaborating = ["--experts", "remote", "--initial-peers", "10.1.2.3:31337", "--collaborate", "run",
                     "--target-batch-size", "64", "--averaging-host", "0.0.0.0"]
    with pytest.raises(SystemExit):
        train.parse_config([*collaborating, "--averaging-announce-host", host])
    assert "--averaging-announce-host" in capsys.readouterr().err
    with pytest.raises(ValueError, match="announce_host"):
        AveragerConfig(announce_host=host)
    with pytest.raises(ValueError, match="state_announce_host"):
        CollaborationConfig(target_batch_size=8, state_announce_host=host)


def test_an_announce_host_in_any_form_of_an_address_or_name_is_taken():
    parser = run_server.build_parser()
    for host in ("203.0.113.5", "2001:db8::1", "[2001:db8::1]", "node-1.example.org", "localhost"):
        assert run_server.check_args(parser.parse_args([*SERVER, "--announce-host", host]), parser) == ["ffn.0"]
        assert AveragerConfig(announce_host=host).announce_host == host
        assert CollaborationConfig(target_batch_size=8, state_announce_host=host).state_announce_host == host


@pytest.mark.parametrize("kwargs, words", [
    ('{"num_heads": 3}', "AssertionError: embed_dim must be divisible by num_heads"),
    ('{"dropout": 2}', "ValueError: dropout probability has to be between 0 and 1"),
    ('{"expansion": -1}', "RuntimeError: Trying to create tensor with negative dimension"),
    ('{"colour": "red"}', "TypeError"),
    # the factory's own arguments: a TypeError of its call, with a traceback (review 75)
    ('{"seed": 1}', "gets its seed from the server's (--seed)"),
    ('{"hidden_dim": 16}', "TypeError: FeedforwardExpert.__init__() got multiple values for argument 'hidden_dim'"),
    ('{"name": "x"}', "TypeError"),
])
def test_expert_kwargs_the_class_refuses_are_a_usage_error_naming_the_flag(kwargs, words, capsys):
    cls = "transformer" if "num_heads" in kwargs else "ffn"
    line = one_error_line(usage_error(run_server.main, [*SERVER, "--expert-cls", cls, "--expert-kwargs", kwargs],
                                      capsys))
    assert line.startswith(f"dmoe-server: error: argument --expert-kwargs: {kwargs} "), line
    assert f"--expert-cls {cls} --hidden-dim 8" in line and words in line, line


def test_expert_kwargs_that_build_an_expert_failing_on_its_sample_input_are_a_usage_error(tmp_path, capsys):
    """Review 75: the class took the value, its forward on the sample input (run to learn the outputs' schema) did
    not, and the server ended in a traceback."""
    module = tmp_path / "resid.py"
    module.write_text("import torch\nfrom torch import nn\nfrom dmoe.experts import register_expert_class\n\n\n"
                      "@register_expert_class('resid_out', lambda batch, hidden: torch.randn(batch, hidden))\n"
                      "class Resid(nn.Module):\n"
                      "    def __init__(self, hidden_dim, out=0):\n"
                      "        super().__init__()\n"
                      "        self.linear = nn.Linear(hidden_dim, out or hidden_dim)\n\n"
                      "    def forward(self, x):\n"
                      "        return x + self.linear(x)\n")
    line = one_error_line(usage_error(run_server.main, [*SERVER, "--custom-module", str(module), "--expert-cls",
                                                        "resid_out", "--expert-kwargs", '{"out": 4}'], capsys))
    assert line.startswith('dmoe-server: error: argument --expert-kwargs: {"out": 4} '), line
    assert "RuntimeError: The size of tensor a (8) must match the size of tensor b (4)" in line, line


@pytest.mark.parametrize("flags, words", [
    (["--hidden-dim", "99999999999999999999"], "argument --hidden-dim 99999999999999999999 is absurd (at most 1048576)"),
    (["--hidden-dim", str(2**20)], "argument --hidden-dim: 1 expert of --expert-cls ffn --hidden-dim 1048576: its "
                                   "parameters and their gradients alone take 65,536.1 GiB, more than the "),
    (["--expert-kwargs", '{"expansion": 1000000000000}'],
     'argument --expert-kwargs: 1 expert of --expert-cls ffn --hidden-dim 8 --expert-kwargs {"expansion": '
     '1000000000000}: its parameters and their gradients alone take '),
    # a size torch cannot represent: the message went on with some 40 lines of C++ frames
    (["--expert-kwargs", '{"expansion": 99999999999999999999}'], "Overflow when unpacking long long"),
])
def test_an_absurd_expert_size_is_one_line_naming_the_flag_that_sets_it(flags, words, capsys):
    """--hidden-dim 99999999999999999999 ended in 40 lines of C++ frames blaming --expert-kwargs, not given; an
    expert too large for the machine in torch's allocator error (review 100 D8)."""
    assert words in one_error_line(usage_error(run_server.main, [*SERVER, *flags], capsys))


def test_a_class_that_builds_no_expert_without_kwargs_is_refused_naming_the_class_not_the_kwargs(tmp_path, capsys):
    module = tmp_path / "broken.py"
    module.write_text("from torch import nn\nfrom dmoe.experts import register_expert_class\n\n\n"
                      "@register_expert_class('broken_init', lambda batch, hidden: None)\n"
                      "class Broken(nn.Module):\n"
                      "    def __init__(self, hidden_dim):\n"
                      "        raise ValueError('not today')\n")
    line = one_error_line(usage_error(run_server.main, [*SERVER, "--custom-module", str(module), "--expert-cls",
                                                        "broken_init"], capsys))
    assert line == ("dmoe-server: error: argument --expert-cls: broken_init (with --hidden-dim 8) builds no expert: "
                    "ValueError: not today"), line


def test_ports_taken_at_start_are_usage_errors_naming_the_flag(capsys):
    """A taken --metrics-port ended in an OSError traceback, and a taken --dht-port was reported as a bad
    --initial-peers (review 49), with --processes too."""
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp.bind(("127.0.0.1", 0))
        taken_tcp, taken_udp = tcp.getsockname()[1], udp.getsockname()[1]
        line = one_error_line(usage_error(run_server.main, [*SERVER, "--metrics-port", str(taken_tcp)], capsys))
        assert line.startswith(f"dmoe-server: error: argument --metrics-port: the metrics endpoint cannot listen on "
                               f"127.0.0.1:{taken_tcp}: "), line
        for more in ([], ["--experts", "ffn.[0:2]", "--processes", "2"]):
            line = one_error_line(usage_error(run_server.main, [*SERVER, "--dht-port", str(taken_udp), *more],
                                              capsys))
            assert line.startswith(f"dmoe-server: error: argument --dht-port: the DHT node cannot listen on "
                                   f"127.0.0.1:{taken_udp} (UDP): "), line
    line = one_error_line(usage_error(run_server.main, [*SERVER, "--metrics-port", "0", "--metrics-host",
                                                        "no-such-host.invalid"], capsys))
    assert line.startswith("dmoe-server: error: argument --metrics-host: the metrics endpoint cannot listen on "
                           "no-such-host.invalid:0: "), line


def test_a_join_that_fails_still_names_the_initial_peers():
    error = run_server.dht_node_error(ConnectionError("none of the initial DHT peers answered"), "127.0.0.1", 0)
    assert error == "argument --initial-peers: none of the initial DHT peers answered"
    taken = OSError(98, "Address already in use")
    assert run_server.dht_node_error(taken, "::1", 7).startswith("argument --dht-port: the DHT node cannot listen "
                                                                  "on [::1]:7 (UDP): ")
    assert run_server.dht_node_error(OSError(99, "Cannot assign requested address"), "10.9.9.9", 0) \
        .startswith("argument --host: ")


def test_every_server_and_trainer_flag_has_help():
    for parser in (run_server.build_parser(), train.build_parser(), monitor_program.build_parser(),
                   dht_program.build_parser()):
        missing = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
        assert not missing, f"{parser.prog}: flags without help: {missing}"


def help_entries(parser) -> dict[str, str]:
    """``parser``'s --help as one line per flag (the help wrapped at 1000 columns): flag -> its entry."""
    parser.formatter_class = functools.partial(parser.formatter_class, width=1000, max_help_position=60)
    entries, flag = {}, None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line.strip()
        elif flag is not None and line.startswith("   "):  # a help below a long flag
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_every_programs_help_shows_each_meaningful_default_once():
    """Review 57: dmoe-server --help showed almost no defaults (--lr, --hidden-dim, --host, ...), dmoe-dht's --host
    none, and dmoe-train's --checkpoint two: "(default: OUT_DIR/checkpoint.pt) (default: None)"."""
    from dmoe.cli import demo

    parsers = [run_server.build_parser(), train.build_parser(), monitor_program.build_parser(),
               dht_program.build_parser(), demo.help_parser(1), demo.help_parser(3)]
    for parser in parsers:
        entries = help_entries(parser)
        for action in parser._actions:
            if not action.option_strings or action.help is None or action.dest == "help":
                continue
            entry = entries[action.option_strings[0]]
            assert "(default: None)" not in entry and "(default: ())" not in entry, (parser.prog, entry)
            assert entry.lower().count("default:") <= 1, (parser.prog, entry)  # one default, hand-written or not
            shown = default_shown(action)
            if shown is not None:
                assert "default:" in entry, (parser.prog, entry)
    server = help_entries(run_server.build_parser())
    for flag, default in (("--lr", "0.001"), ("--hidden-dim", "1024"), ("--host", "127.0.0.1"),
                          ("--max-batch-size", "4096"), ("--refresh-period", "10.0"),
                          ("--checkpoint-interval", "60.0"), ("--replicas", "2"), ("--log-level", "INFO")):
        assert server[flag].endswith(f"(default: {default})"), server[flag]
    assert server["--overlap-copies"].endswith("(default: plain copies, faster on the GPUs measured; "
                                               "benchmarks/README.md)"), server["--overlap-copies"]
    assert "default: --host, or for 0.0.0.0 this machine's address toward its DHT peers" in server["--announce-host"]
    for parser in (train.build_parser(), demo.help_parser(1)):
        entry = help_entries(parser)["--checkpoint"]
        assert entry.endswith("checkpoint file (default: OUT_DIR/checkpoint.pt)"), entry
    trainer = help_entries(train.build_parser())
    assert trainer["--grid"].endswith("(default: 4 4)"), trainer["--grid"]
    assert trainer["--initial-peers"].endswith("(with --experts remote)"), trainer["--initial-peers"]
    dht = help_entries(dht_program.build_parser())
    assert dht["--host"].endswith("(default: 127.0.0.1)") and dht["--ksize"].endswith("DHTConfig.ksize (default: 20)")


@pytest.mark.parametrize("flags, named", [
    (["--grid", "4", "0"], "--grid"),
    (["--layers", "ffn.0"], "--layers"),
    (["--initial-peers", "nowhere"], "--initial-peers"),
    (["--port", "70000"], "--port"),
    (["--period", "0"], "--period"),
    (["--period", "inf"], "--period"),
    (["--grid", "1000", "1000"], "--grid"),
    ([], "--initial-peers"),
])
def test_monitor_rejects_bad_flags_naming_them(flags, named, capsys):
    argv = flags if "--initial-peers" in flags or not flags else ["--initial-peers", "127.0.0.1:1", *flags]
    assert named in usage_error(monitor_program.main, argv, capsys)


def test_choose_experts_takes_free_cells_only():
    """A served cell's uid is its server's: a second server choosing it (once done when free cells ran out) served
    an expert it could never declare, logging an error every refresh (review 56)."""
    taken = {"ffn0.0.0", "ffn0.0.1", "ffn0.1.0"}
    chosen = choose_experts(["ffn0"], (2, 2), 1, taken, random.Random(0))
    assert chosen == ["ffn0.1.1"]
    chosen = choose_experts(["ffn0", "ffn1"], (2, 2), 2, taken, random.Random(0))
    assert chosen[0] == "ffn0.1.1" and len(chosen) == 3 and len(set(chosen[1:])) == 2
    assert all(uid.startswith("ffn1.") for uid in chosen[1:])
    assert choose_experts(["ffn0"], (2, 2), 2, taken | {"ffn0.1.1"}) == []
    with pytest.raises(ValueError):
        choose_experts(["ffn0"], (2, 2), 5)


class FakeDHT:
    def __init__(self, endpoints: dict[str, str]):
        self.endpoints = endpoints
        self.calls = 0

    def get_alive_continuations(self, prefixes, experts_under=()):
        self.calls += 1
        result = {}
        for prefix in prefixes:
            depth = prefix.count(".") + 1
            result[prefix] = {int(uid.split(".")[depth]): endpoint for uid, endpoint in self.endpoints.items()
                              if uid.startswith(prefix + ".")}
        return result


def test_alive_experts_walks_one_dimension_per_lookup_and_ignores_cells_outside_the_grid():
    dht = FakeDHT({"ffn0.0.1": "a:1", "ffn0.3.0": "b:2", "ffn0.1.9": "c:3", "ffn1.0.0": "d:4"})
    assert alive_experts(dht, "ffn0", (4, 4)) == {"ffn0.0.1": "a:1", "ffn0.3.0": "b:2"}
    assert dht.calls == 2


def test_num_experts_server_fills_the_cells_a_first_server_left_free():
    with running("-m", "dmoe.dht", "--port", "0") as dht:
        common = ["-m", "dmoe.cli.server", "--hidden-dim", "8", "--expert-cls", "nop",
                  "--initial-peers", dht.endpoint()]
        with running(*common, "--experts", "ffn0.0.[0:2]") as first:
            first.endpoint()  # printed once its experts are declared
            with running(*common, "--num-experts", "2", "--grid", "2", "2", "--layer", "ffn0") as second:
                second.endpoint()
                (line,) = [line for line in second.output if "chose 2 experts" in line]
                assert sorted(line.split(": ")[-1].strip().split(", ")) == ["ffn0.1.0", "ffn0.1.1"]
                second.popen.send_signal(signal.SIGINT)
                started = time.monotonic()
                assert second.popen.wait(30) == 0
                assert time.monotonic() - started < 10


@pytest.mark.parametrize("flags, named", [
    (["--port", "70000"], "--port"),
    (["--log-level", "bogus"], "--log-level"),
    (["--initial-peers", "nowhere"], "--initial-peers"),
    (["--routing-refresh-period", "0"], "argument --routing-refresh-period: "),
    (["--max-concurrent-rpcs", "0"], "argument --max-concurrent-rpcs: "),
    (["--rpc-timeout", "inf"], "argument --rpc-timeout: "),  # named the setting, not the flag (review 79)
    (["--ksize", "0"], "argument --ksize: "),
])
def test_dht_program_rejects_bad_flags_naming_them(flags, named, capsys):
    from dmoe.cli import dht as dht_program

    assert named in usage_error(dht_program.main, flags, capsys)


@pytest.mark.parametrize("flags, words", [
    (["--socket-buffer-bytes", "3000000000"], "socket_buffer_bytes must be at most 2147483647"),  # was a TypeError
    (["--max-expiration", "nan"], "max_expiration must be positive"),  # nan started a node that stored nothing
    (["--default-expiration", "nan"], "default_expiration must be positive"),
    (["--max-expiration", "inf"], "max_expiration must be finite"),
])
def test_dht_settings_out_of_a_c_int_or_nan_are_refused(flags, words, capsys):
    from dmoe.cli import dht as dht_program

    with pytest.raises(SystemExit) as exit_info:
        dht_program.parse_args(flags)
    assert exit_info.value.code == 2
    *_, line = capsys.readouterr().err.rstrip("\n").split("\n")
    assert line.startswith(f"dmoe-dht: error: argument {flags[0]}: ") and words in line, line


def test_dht_program_stops_at_once_while_joining_a_silent_peer_and_fails_with_status_1():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    try:
        peer = f"127.0.0.1:{silent.getsockname()[1]}"
        with running("-m", "dmoe.dht", "--initial-peers", peer, "--rpc-timeout", "30") as dht:
            dht.wait_for("bound to UDP")
            started = time.monotonic()
            dht.popen.send_signal(signal.SIGINT)
            assert dht.popen.wait(30) == 0
            assert time.monotonic() - started < 10  # not the 30 s its join would take
        with running("-m", "dmoe.dht", "--initial-peers", peer, "--rpc-timeout", "0.5") as dht:
            assert dht.popen.wait(60) == 1  # python -m dmoe.dht says it failed
    finally:
        silent.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_dht_program_exits_promptly_on_signal(signum):
    with running("-m", "dmoe.dht", "--port", "0") as dht:
        dht.endpoint()
        started = time.monotonic()
        dht.popen.send_signal(signum)
        assert dht.popen.wait(30) == 0
        assert time.monotonic() - started < 10  # generous: the CI machine is shared; a hang would take 30


def test_the_dht_program_leaves_an_ignored_sigint_ignored_as_the_server_does():
    """Review 96 D-low-4: a node started in a script's background (SIGINT ignored) stopped on a Ctrl-C meant for
    the script's foreground, while the script's servers stayed up."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    seen: dict[str, object] = {}

    async def start(node):  # once the node is up, before it says it listens
        seen["sigint"] = signal.getsignal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)  # still a stop

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        asyncio.run(dht_program.run(dht_program.parse_args(["--port", "0"]), start))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert seen["sigint"] == signal.SIG_IGN


def test_the_metrics_endpoint_may_stay_on_another_interface_than_the_experts():
    parser = run_server.build_parser()
    args = parser.parse_args(["--experts", "ffn.0", "--host", "0.0.0.0", "--metrics-port", "0",
                              "--metrics-host", "127.0.0.1"])
    config = run_server.server_config(args, parser)
    assert (config.host, config.metrics_host, config.metrics_port) == ("0.0.0.0", "127.0.0.1", 0)
    assert run_server.server_config(parser.parse_args(["--experts", "ffn.0"]), parser).metrics_host is None
