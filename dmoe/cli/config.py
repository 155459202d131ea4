"""Config files for dmoe programs: a TOML file whose keys are the program's flags, which flags on the command line
override.

    # server.toml                       dmoe-server --config server.toml --port 6000
    experts = "ffn0.[0:4].[0:4]"
    hidden-dim = 512                   # dashes or underscores, as you like
    initial_peers = ["10.0.0.1:31337"]
    expert-kwargs = { num_heads = 8 }  # a table where a flag takes a JSON object (here: --expert-cls transformer)

Every value goes through the same type check and ``choices`` as the flag it stands for, so a bad key or value
fails with the same kind of one-line error a bad flag does, naming the key and what is allowed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

CONFIG_DEST = "config"


class ConfigError(ValueError):
    """A config file that cannot be read, or a key or value in it that the program does not accept."""


def _finite(value: Any, text: str) -> None:
    """Refuses inf (nan fails the callers' comparisons): an infinite size, rate or period of time ended in an
    OverflowError where it was first turned into an int, or trained weights into inf, long after the flags were
    read."""
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` that must be > 0 and finite (the error names the value)."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        _finite(value, text)
        return value
    parse.__name__ = f"positive {kind.__name__}"  # argparse shows it in "invalid positive int value"
    return parse


def non_negative(kind: type) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` that must be >= 0 and finite."""
    def parse(text: str):
        value = kind(text)
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        _finite(value, text)
        return value
    parse.__name__ = f"non-negative {kind.__name__}"
    return parse


#: the longest duration any time flag takes, in seconds: a year. Python's waits (``Event.wait``, ``Lock.acquire``,
#: ``socket.settimeout``) take at most ``threading.TIMEOUT_MAX`` (about 9.2e9 s, 2**63 ns) and raise OverflowError
#: beyond it, in a thread long after the flags were read: a --forward-timeout of 1e10 lost every expert, a
#: --checkpoint-interval of 1e10 the checkpoint thread (review 72). No wait a user means is longer than a year.
MAX_SECONDS = 365 * 24 * 3600.0


#: the most threads a thread-count flag may ask for (dmoe-train's --threads, dmoe-server's --torch-threads and
#: --workers): torch crashed on 100000 (dmoe-server died of a segmentation fault with no word), and 100000 compute
#: workers grew the server to 21k threads before it died in a traceback (review 100 D4)
MAX_THREADS = 1024


def check_thread_count(flag: str, value: int | None) -> None:
    """Raises ValueError naming ``flag`` for a thread count above :data:`MAX_THREADS` (None: not given)."""
    if value is not None and value > MAX_THREADS:
        raise ValueError(f"{flag} {value} is absurd (at most {MAX_THREADS}; this machine has {os.cpu_count()} "
                         "cores)")


def duration(unit: str = "s", *, zero: bool = False) -> Callable[[str], float]:
    """An argparse type for a duration counted in ``unit`` ("s", "min" or "ms"): a float > 0 (>= 0 with ``zero``),
    finite, and at most :data:`MAX_SECONDS` in that unit; the error names the bound."""
    scale = {"s": 1.0, "min": 60.0, "ms": 1e-3}[unit]
    base = non_negative(float) if zero else positive(float)
    most = MAX_SECONDS / scale
    words = {"s": "seconds", "min": "minutes", "ms": "ms"}[unit]

    def parse(text: str) -> float:
        value = base(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:.0f} {words} (a year), got {text}")
        return value
    parse.__name__ = f"{'non-negative' if zero else 'positive'} duration"
    return parse


def port_number(text: str) -> int:
    """An argparse type for a TCP/UDP port; 0 lets the OS pick a free one."""
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0: any free port), got {text}")
    return value


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """The help formatter of every dmoe program: each flag's help ends with its default, "(default: X)", where the
    default means something. None shows nothing (such a flag's help says in words what leaving it out does, e.g.
    "default: --host"), nor do an empty list, an on/off flag's False, or a help that already states its default
    ("default: ..."): argparse's ArgumentDefaultsHelpFormatter wrote "(default: None)" beside those, so that some
    flags showed two defaults. A list shows as it is typed: "4 4", not "[4, 4]"."""

    #: what argparse's BooleanOptionalAction (Python < 3.14) appends to its help itself
    _APPENDED = " (default: %(default)s)"

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if text.endswith(self._APPENDED):
            text = text[:-len(self._APPENDED)]
        shown = default_shown(action)
        if shown is None or "default:" in text.lower() or "%(default)" in text:
            return text
        return f"{text} (default: {shown.replace('%', '%%')})"


def default_shown(action: argparse.Action) -> str | None:
    """How ``--help`` shows ``action``'s default; None where it is not shown (see :class:`DefaultsHelpFormatter`)."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or not action.option_strings:
        return None
    if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):  # store_true & co: off
        return None
    if isinstance(default, (list, tuple, dict, set)):
        if not default:
            return None
        return json.dumps(default) if isinstance(default, dict) else " ".join(map(str, default))
    return str(default)


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config FILE.toml`` to ``parser`` (call :func:`parse_args` instead of ``parser.parse_args``)."""
    parser.add_argument("--config", metavar="FILE.toml", default=None,
                        help="read defaults for any of these flags from a TOML file (keys are flag names, dashes or "
                             "underscores); flags given on the command line override it")


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file's top-level table; raises :class:`ConfigError` saying why it cannot be read."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise ConfigError(f"cannot read it: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:  # a Latin-1 comment, a UTF-16 file: every program ended in a traceback
        line = data.count(b"\n", 0, error.start) + 1  # (review 100 D5)
        raise ConfigError(f"not UTF-8 text (a TOML file must be UTF-8): byte 0x{data[error.start]:02x} on line "
                          f"{line}: {error.reason}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"not valid TOML: {error}") from None


def _allowed_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions
            if action.option_strings and action.dest not in (CONFIG_DEST, "help", argparse.SUPPRESS)}


def _as_text(value: Any) -> str:
    """What a user would have typed after the flag for this TOML value. Raises :class:`ConfigError` for a table
    holding what JSON has no form of (a TOML date or time)."""
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            raise ConfigError(f"expected a table of JSON values (no dates or times), got {value!r}") from None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _shown(value: Any) -> str:
    """``value`` as :func:`_as_text` writes it, for a message: never fails."""
    try:
        return _as_text(value)
    except ConfigError:
        return repr(value)


def _convert_one(action: argparse.Action, key: str, value: Any) -> Any:
    if isinstance(value, (list, dict)) and not (isinstance(value, dict) and action.type is not None):
        raise ConfigError(f"key {key!r}: expected a single value, got {_shown(value)}")
    try:
        text = _as_text(value)
    except ConfigError as error:  # (it raised a TypeError, in the except clause below too: a traceback)
        raise ConfigError(f"key {key!r}: {error}") from None
    if action.type is None:
        result = text
    else:
        try:
            result = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
            if isinstance(error, argparse.ArgumentTypeError):  # its message says what is allowed and what came
                raise ConfigError(f"key {key!r}: {error}") from None
            kind = getattr(action.type, "__name__", "value")
            raise ConfigError(f"key {key!r}: expected {kind}, got {text!r}") from None
    if action.choices is not None and result not in action.choices:
        allowed = ", ".join(map(str, action.choices))
        raise ConfigError(f"key {key!r}: {text!r} is not one of {allowed}")
    return result


def convert_value(action: argparse.Action, key: str, value: Any) -> Any:
    """Checks and converts one TOML value as ``action``'s flag would; raises :class:`ConfigError` naming ``key``."""
    if action.nargs == 0:  # --flag / --no-flag / store_true
        if not isinstance(value, bool):
            raise ConfigError(f"key {key!r}: expected true or false, got {_shown(value)!r}")
        return value
    many = action.nargs in ("*", "+") or isinstance(action.nargs, int) or isinstance(action, argparse._AppendAction)
    if not many:
        return _convert_one(action, key, value)
    items = value if isinstance(value, list) else [value]
    if action.nargs == "+" and not items:
        raise ConfigError(f"key {key!r}: expected at least one value")
    if isinstance(action.nargs, int) and len(items) != action.nargs:
        raise ConfigError(f"key {key!r}: expected {action.nargs} values, got {len(items)}")
    return [_convert_one(action, key, item) for item in items]


def config_defaults(parser: argparse.ArgumentParser, table: dict[str, Any]) -> dict[str, Any]:
    """Maps a config table onto ``parser``'s destinations, checking every key and value.

    Raises :class:`ConfigError` for a key that is no flag of the program (listing the allowed ones) and for a
    value its flag would refuse.
    """
    allowed = _allowed_keys(parser)
    values, spelled = {}, {}
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        action = allowed.get(key)
        if action is None:
            names = ", ".join(sorted(name.replace("_", "-") for name in allowed))
            raise ConfigError(f"unknown key {raw_key!r}; allowed keys: {names}")
        if key in spelled:  # batch-size and batch_size: one flag set twice, one value silently lost otherwise
            raise ConfigError(f"keys {spelled[key]!r} and {raw_key!r} set the same flag; keep one")
        spelled[key] = raw_key
        values[key] = convert_value(action, raw_key, value)
    return values


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with defaults taken from ``--config FILE`` when given.

    Flags on the command line win over the file; a key the file sets counts as given for required flags. Errors
    in the file end the program with one line (exit status 2), as argparse does for a bad flag. The returned
    namespace has no ``config`` attribute. :func:`parse_given` also says which flags were given.
    """
    return parse_given(parser, argv)[0]


def parse_given(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
                alternatives: Sequence[tuple[frozenset[str], frozenset[str]]] = ()
                ) -> tuple[argparse.Namespace, frozenset[str]]:
    """:func:`parse_args`, and the destinations of the flags that were given: on the command line or as a key of
    the config file. A check such as "--checkpoint-interval needs --checkpoint-dir" asks this, not whether the value
    differs from the default: a user who typed the default was not told that the flag did nothing (review 72).

    A repeatable flag (``action="append"``) given on the command line replaces the file's list, as any other flag
    overrides the file (argparse appended to it: a broken --custom-module of the file could not be replaced).

    ``alternatives``: pairs of sets of destinations that exclude each other (``--experts`` or ``--num-experts
    --grid --layer``): one side given on the command line, and none of the other, drops what the file gives of the
    other, as a flag overrides the file's key (the file's ``num-experts`` made ``--experts`` a usage error, review
    92)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    from_file: dict[str, Any] = {}
    if known.config is not None and not known.config.strip():  # (an unset shell variable: "config : cannot read")
        parser.exit(2, f"{parser.prog}: error: argument --config: must name a TOML file (leave it out for none)\n")
    if known.config is not None:
        try:
            from_file = config_defaults(parser, read_toml(known.config))
        except ConfigError as error:
            parser.exit(2, f"{parser.prog}: error: config {known.config}: {error}\n")
        for action in parser._actions:
            if action.dest in from_file:
                action.required = False
        parser.set_defaults(**from_file)
        typed_first = command_line_values(parser, argv) if alternatives else {}
        for one, other in alternatives:
            for mine, theirs in ((one, other), (other, one)):
                if mine & typed_first.keys() and not theirs & typed_first.keys():
                    dropped = theirs & from_file.keys()
                    for action in parser._actions:
                        if action.dest in dropped:
                            parser.set_defaults(**{action.dest: None})
                    for dest in dropped:
                        del from_file[dest]
    args = parser.parse_args(argv)  # (exits on a bad flag, so the parse below sees only good ones)
    typed = command_line_values(parser, argv)
    for action in parser._actions:
        if isinstance(action, (argparse._AppendAction, argparse._AppendConstAction)) and action.dest in typed:
            setattr(args, action.dest, typed[action.dest])
    vars(args).pop(CONFIG_DEST, None)
    return args, frozenset(set(typed) | set(from_file)) - {CONFIG_DEST}


def command_line_values(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The values of the flags ``argv`` gives, by destination, with no defaults: ``parser`` parses it again with
    every default suppressed (argparse then sets only what it read, however the flag was spelled: ``--flag=V``,
    an abbreviation). ``argv`` must have parsed already."""
    saved = [(action, action.default, action.required) for action in parser._actions]
    parser_defaults = parser._defaults
    try:
        parser._defaults = {}
        for action in parser._actions:
            action.default, action.required = argparse.SUPPRESS, False
        values, _ = parser.parse_known_args(argv)
    finally:
        parser._defaults = parser_defaults
        for action, default, required in saved:
            action.default, action.required = default, required
    return vars(values)
