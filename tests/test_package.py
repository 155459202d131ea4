"""The package's public face: every name of ``dmoe.__all__`` resolves (imported on first use), and programs that
need no torch, like the DHT node, start without importing it."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import dmoe
from dmoe.launch import ROOT


def test_every_public_name_resolves_to_the_object_its_module_defines():
    assert set(dmoe.__all__) == set(dmoe._EXPORTS)  # the documented names are exactly the lazy ones
    for name in dmoe.__all__:
        assert getattr(dmoe, name) is getattr(importlib.import_module(dmoe._EXPORTS[name]), name), name
    assert set(dmoe.__all__) <= set(dir(dmoe))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        dmoe.NoSuchThing  # noqa: B018


def test_star_import_gives_the_public_api():
    namespace: dict = {}
    exec("from dmoe import *", namespace)
    assert namespace["ExpertServer"] is dmoe.ExpertServer and namespace["DHT"] is dmoe.DHT


def test_the_dht_node_program_does_not_import_torch():
    code = ("import sys, dmoe, dmoe.cli.dht, dmoe.dht, dmoe.directory.declarations; "
            "print(sorted(m for m in ('torch', 'numpy', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
