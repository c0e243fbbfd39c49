"""The README's snippets and the manual's code blocks (docs/MANUAL.md) run as written."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/MANUAL.md")
BLOCKS = [(name, block) for name in DOCUMENTS
          for block in re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(), flags=re.S)]


def test_readme_has_a_snippet_per_front():
    snippets = [block for name, block in BLOCKS if name == "README.md"]
    assert len(snippets) == 4 and all(name in "".join(snippets) for name in (
        "GraphRunner(", "wrap(", "graph_generate(", "engine_model("))


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
    name, block = BLOCKS[index]
    exec(compile(block, f"{name}[block {index}]", "exec"), {"__name__": "__readme__"})
