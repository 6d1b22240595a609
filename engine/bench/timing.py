"""Timing on the device: the median of repeated runs, and CUDA-graph replays timed with events."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def replay_ms(graph: torch.cuda.CUDAGraph, times: int = 50) -> float:
    """Mean milliseconds of one replay of a captured CUDA graph, back to back, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / times
