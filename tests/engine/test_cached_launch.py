"""CachedLaunch's dispatch logic on the CPU. The JIT function and its compiled kernel are
stand-ins (recording what they are called with): a compiled Triton kernel cannot run here. The
real kernels go through CachedLaunch in the GPU kernel tests (test_triton_kernels.py)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from engine.kernels.cached_launch import CachedLaunch, specialization_key


@dataclass
class Param:
    name: str
    do_not_specialize: bool = False
    do_not_specialize_on_alignment: bool = False
    default: object = inspect.Parameter.empty


class Compiled:
    def __init__(self, log: list) -> None:
        self.log = log

    def __getitem__(self, grid):
        return lambda *values: self.log.append(("compiled", grid, values))


class Jit:
    """Params X (pointer), n (int), m (int, not specialized), BLOCK (constexpr) with a default."""

    def __init__(self) -> None:
        self.params = [Param("X"), Param("n"), Param("m", do_not_specialize=True), Param("BLOCK", default=64)]
        self.log: list = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return Compiled(self.log)

        return run


def test_key_follows_triton_specialization():
    x = torch.zeros(64, dtype=torch.bfloat16)
    spec, align = (True, True, False), (True, True, True)

    def key(*args, **kw):
        return specialization_key(args, kw, spec, align)

    assert key(x, 32, 5) == key(x[8:], 48, 7)  # both 16-byte aligned, n % 16 == 0, m not specialized
    assert key(x, 32, 5) != key(x[1:], 32, 5)  # misaligned pointer
    assert key(x, 32, 5) != key(x.float(), 32, 5)  # dtype
    assert key(x, 32, 5) != key(x, 33, 5) != key(x, 1, 5)  # divisibility, the value 1
    assert key(x, 32, 5) != key(x, 32, 2**40)  # a wider int even when not specialized
    assert key(x, 32, 5, BLOCK=64) != key(x, 32, 5, BLOCK=128)  # constexprs and options by value
    assert key(x, 32, 5) != key(x, 32.0, 5)


def test_first_launch_compiles_then_the_compiled_kernel_launches_directly():
    jit = Jit()
    launch = CachedLaunch(jit)
    x = torch.zeros(64, dtype=torch.bfloat16)
    launch[(4, 2)](x, 32, 5, BLOCK=128)
    launch[(7,)](x, 48, 9, BLOCK=128)  # same specialization: the compiled launcher, all params in order
    launch[(7,)](x, 48, 9)  # no BLOCK: a new key; its first launch is the JIT's (which applies the default)
    launch[(7,)](x, 48, 9)
    launch[(3,)](x[1:], 48, 9, BLOCK=128)  # misaligned: Triton would compile another variant
    kinds = [e[0] for e in jit.log]
    assert kinds == ["jit", "compiled", "jit", "compiled", "jit"]
    assert jit.log[1] == ("compiled", (7, 1, 1), (x, 48, 9, 128))
    assert jit.log[3] == ("compiled", (7, 1, 1), (x, 48, 9, 64))  # the parameter's default
    assert launch.num_specializations == 3


def test_interpreted_functions_always_go_through_the_jit():
    class Interpreted:  # TRITON_INTERPRET=1: no params, nothing compiled
        def __init__(self) -> None:
            self.calls = 0

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.calls += 1

            return run

    fn = Interpreted()
    launch = CachedLaunch(fn)
    for _ in range(3):
        launch[(1,)](torch.zeros(4), 3)
    assert fn.calls == 3 and launch.num_specializations == 0
