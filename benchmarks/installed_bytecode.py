"""Byte-compile the kvdiag package the benchmarks' CLI runs import, as ``pip install`` does for a wheel.

An editable install (``make venv``) ships no bytecode; Python writes it on first import unless
``PYTHONDONTWRITEBYTECODE`` is set (as on some CI machines), and then every CLI run compiles about a hundred
modules from source again (≈ 0.09 s of CPU per run, a tenth of one conversation's explain). The CLI figures
are meant to be those of an installed kvdiag, so the benchmarks compile first.
"""

from __future__ import annotations

import compileall
import re
import sys
from pathlib import Path


def compile_package(tree: Path | None = None) -> None:
    """Write the bytecode of the kvdiag package (this install's, or ``tree/kvdiag``)."""
    if tree is None:
        import kvdiag

        root = Path(kvdiag.__file__).resolve().parent
    else:
        root = (tree / "kvdiag").resolve()
    # (the test suite and the virtual environments inside a checkout are not what the CLI imports)
    skip = re.compile(r"/(\.venv|\.vllm-venv|build|tests|benchmarks|demo-out)/")
    if not compileall.compile_dir(str(root), quiet=1, rx=skip):
        print(f"note: some modules under {root} did not compile", file=sys.stderr)
