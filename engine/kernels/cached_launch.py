"""Launch a compiled Triton kernel without the JIT's per-call dispatch.

``kernel[grid](...)`` binds every argument, derives Triton's specialization (pointer alignment,
integers equal to 1 or divisible by 16, integer widths), builds a cache key, checks globals and
only then launches: 30-150 us of host time per launch on the H200 host (docs/performance.md),
more than many of the kernels take on the device. The eager attention of a mixed step launches
~160 of them, so a chunked-prefill step was host-bound.

``CachedLaunch`` keeps, per specialization, the ``CompiledKernel`` the JIT returned for its first
launch and later launches it directly. Its key holds exactly what Triton specializes on, so a
call that Triton would compile differently (a misaligned view, an integer that becomes 1, a new
constexpr or launch option) goes through the JIT again and gets its own entry. Under the CPU
interpreter (``TRITON_INTERPRET=1``) there is nothing compiled: every call goes to the JIT.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def int_width(v: int) -> str:
    """The integer type Triton gives an int argument."""
    if _I32[0] <= v < _I32[1]:
        return "i32"
    return "i64" if _I64[0] <= v < _I64[1] else "u64"


def specialization_key(args: tuple, kwargs: dict[str, Any], specialize: tuple[bool, ...], align: tuple[bool, ...]) -> tuple:
    """What a Triton launch compiles on: per positional argument (tensor dtype and 16-byte
    alignment; int width, ==1 and %16 unless not specialized; float; anything else by value),
    then the keyword arguments (constexprs and launch options) by value."""
    key: list = []
    for v, spec, al in zip(args, specialize, align):
        if isinstance(v, torch.Tensor):
            key.append((v.dtype, al and v.data_ptr() % 16 == 0))
        elif isinstance(v, bool):
            key.append(("u1",))
        elif isinstance(v, int):
            key.append((int_width(v), v == 1, v % 16 == 0) if spec else (int_width(v),))
        elif isinstance(v, float):
            key.append(("fp32",))
        else:
            key.append(v)
    key.append(tuple(kwargs.items()))
    return tuple(key)


class CachedLaunch:
    """``CachedLaunch(jit_fn)[grid](*args, **constexprs_and_options)``: the JIT's launch for a new
    specialization, the compiled kernel's own launcher after that. Positional arguments must be
    the kernel's runtime parameters in order; constexprs and options go by keyword."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = getattr(fn, "params", None)  # None: the interpreter's InterpretedFunction
        self.compiled_path = params is not None
        self._specialize = tuple(not p.do_not_specialize for p in params) if params else ()
        self._align = tuple(not p.do_not_specialize_on_alignment for p in params) if params else ()
        self._names = [p.name for p in params] if params else []
        self._defaults = {p.name: p.default for p in params or () if p.default is not inspect.Parameter.empty}
        self._compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launch(grid, args, kwargs)

        return launch

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.compiled_path:
            self.fn[grid](*args, **kwargs)
            return
        key = specialization_key(args, kwargs, self._specialize, self._align)
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.fn[grid](*args, **kwargs)  # compiles (or finds) and launches
            return
        # The compiled launcher takes every parameter in order, constexprs included (it skips them).
        values = list(args)
        for name in self._names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self._defaults[name])
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*values)

    @property
    def num_specializations(self) -> int:
        """Compiled variants launched directly so far (tests, diagnostics)."""
        return len(self._compiled)
