"""What every test process starts from, however the suite was launched.

A shell without job control starts its background jobs (``make test &``, a script's ``cmd &``) with SIGINT ignored,
and that disposition survives ``exec`` into pytest, its workers and every program a test starts. dmoe's programs
deliberately leave an ignored stop signal ignored (as ``nohup`` asks), so the tests of Ctrl-C then failed: the
signal they sent never arrived. Each test process takes Python's own SIGINT handler back first; the programs the
tests start then get the default disposition, as from a terminal.
"""
from __future__ import annotations

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
