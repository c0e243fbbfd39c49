"""The examples run as documented (CPU smoke tests)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script,expected", [
    ("examples/wrap_callable.py", "graph runs"),
    ("examples/decode_loop.py", "same tokens: True"),
    ("examples/chunked_prefill.py", "same tokens: True"),
    ("examples/host_batches.py", "same tokens: True"),
    pytest.param("examples/hf_decode.py", "same tokens: True",
                 marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")),
    pytest.param("examples/hf_generate.py", "same tokens: True",
                 marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")),
])
def test_example_runs(script, expected):
    result = subprocess.run([sys.executable, str(ROOT / script)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                 "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]})  # conftest: one thread
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout
