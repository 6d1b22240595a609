"""The Triton kernel tests on the CPU: test_triton_kernels.py in a pytest process of its own with
Triton's interpreter on from the start (it cannot be switched on once triton is imported, and
switched on for this whole session it would also hide CPU paths that wrongly launch a kernel)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_the_triton_kernels_match_their_references_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}  # the CPU, also on a GPU machine
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_triton_kernels.py")],
        cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=1800,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 15 and "skipped" not in summary, summary
