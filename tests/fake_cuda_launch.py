"""Run a Python command line with tests/fake_cuda.py's fake torch.cuda (torch 2.11's rules) installed for the
whole process: scripts/gpu_session.py's steps rehearsed where there is no GPU (``GPU_SESSION_LAUNCHER``).

    python tests/fake_cuda_launch.py -c CODE [args] | -m MODULE [args] | SCRIPT [args]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_cuda import TORCH_2_11, install  # noqa: E402


_INSTALLED = []  # the entered install() block, held: dropped, its generator would close and leave the recording mode


def main(args: list) -> None:
    """Install the fake (never undone: the process ends with the command), then run the command line."""
    _INSTALLED.append(install(pytest.MonkeyPatch(), TORCH_2_11))
    _INSTALLED[-1].__enter__()
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:  # as ``python SCRIPT`` runs it: the script's folder first on the path (its sibling modules import)
        sys.argv = list(args)
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
