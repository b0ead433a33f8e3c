"""Kernel tests on the CPU: a script run under Triton's interpreter (TRITON_INTERPRET=1), which runs
the kernel source the GPU compiles block by block in NumPy. Triton reads the variable when it is
imported, hence a fresh process per script."""

from __future__ import annotations

import os
import subprocess
import sys


def interpret(script: str, cases: list) -> str:
    """Run `script` with repr(cases) as its argument (this directory importable); its stdout."""
    path = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", script, repr(cases)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
