"""Device side of programmatic dependent launch (PDL, Hopper+), shared by the decode kernels.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream
is still running. Before :func:`pdl_wait` it may only *read memory nothing in flight writes*
(weights); everything else - reading the previous kernel's output, any store - comes after it.
Calling ``gdc_launch_dependents`` right after the wait lets the next kernel start its own
prologue now: at most two kernels overlap, and the earlier one has passed its own wait. A kernel
may instead wait with ``RELEASE=False`` and call :func:`pdl_release` later (the decode GEMVs
named in ``GemvPolicy.late_release`` do so after their K loop).
"""

import triton
import triton.language as tl


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr, RELEASE: tl.constexpr = True):
    """Wait for the previous kernel's writes, then (RELEASE) let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Let the next kernel launch (for a kernel that waited with RELEASE=False)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (one request per element, no register result):
    a weight read that may run before :func:`pdl_wait`, while the previous kernel finishes."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(row_ptrs, length, COLUMNS: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the first COLUMNS elements of each row that ``row_ptrs`` [R, 1] starts, LINE
    elements a 128-byte line, 8 lines a row a round, clamped to the row's ``length`` elements:
    how each decode GEMV warms its weight slice before :func:`pdl_wait`."""
    lines = tl.arange(0, 8) * LINE
    for k0 in range(0, COLUMNS, 8 * LINE):
        prefetch_l2(row_ptrs + tl.minimum(k0 + lines, length - 1)[None, :])
