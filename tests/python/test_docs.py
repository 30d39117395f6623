"""The Python that README.md and docs/python.md show runs as written: each ```python block whose
code uses qkv, in a fresh interpreter, in an empty folder (blocks may write files there)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def python_blocks(document):
    with open(os.path.join(ROOT, document), encoding="utf-8") as f:
        text = f.read()
    return [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "qkv" in block]


BLOCKS = [(document, i, block) for document in ("README.md", "docs/python.md")
          for i, block in enumerate(python_blocks(document))]


def test_the_documents_have_samples():
    assert any(document == "README.md" for document, _, _ in BLOCKS)
    assert sum(document == "docs/python.md" for document, _, _ in BLOCKS) >= 5


@pytest.mark.parametrize("document,index,block", BLOCKS, ids=[f"{d}#{i}" for d, i, _ in BLOCKS])
def test_sample_runs(document, index, block, tmp_path):
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{document}, Python block {index}:\n{block}\n{done.stderr}"
