"""The examples run as documented (CPU smoke tests)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script,expected", [
    ("examples/wrap_callable.py", "graph runs"),
    ("examples/decode_loop.py", "same tokens: True"),
])
def test_example_runs(script, expected):
    result = subprocess.run([sys.executable, str(ROOT / script)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout
