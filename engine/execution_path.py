"""How one engine step's forward runs, decided once per step by the model runner's ``prepare``."""

from __future__ import annotations

from enum import StrEnum


class ExecutionPath(StrEnum):
    """The path of one step; the values are the mode names metrics and benchmark JSON use."""

    GRAPH = "graph"  # a decode-only step replayed from its batch bucket's CUDA graph
    MIXED = "mixed"  # decodes plus one prefill chunk replayed as one CUDA graph, attention included
    PIECEWISE = "piecewise"  # CUDA graphs between attentions, attention eager
    NATIVE = "native"  # a decode-only step as one native CPU call (engine/native_decode.py)
    EAGER = "eager"  # the model's forward launched op by op
