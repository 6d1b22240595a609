"""Find where the host waits for the device (CUDA): with async scheduling every such wait in a
step stalls the launch of the next one, so the device idles while Python launches kernels.

``with report_host_syncs(): ...`` turns on PyTorch's sync debug mode and prints the Python stack
of each synchronizing call once (``python -m engine.bench --sync-debug``).
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import torch


@contextmanager
def report_host_syncs(out: TextIO = sys.stderr, depth: int = 10) -> Iterator[dict[str, int]]:
    """Yields {stack: count}; prints each new stack (the innermost ``depth`` frames) as it is seen."""
    counts: dict[str, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
            if "synchroniz" not in str(message):
                return original(message, category, filename, lineno, file, line)
            stack = "".join(traceback.format_stack()[-depth - 2 : -2])  # without this hook's frames
            counts[stack] = counts.get(stack, 0) + 1
            if counts[stack] == 1:
                print(f"host sync: {message}\n{stack}", file=out, flush=True)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
