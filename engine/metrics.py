"""Per-request timings (queue, TTFT, inter-token gaps) and engine-wide counters.

All instants are ``time.perf_counter()`` seconds, one clock for the whole process.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from engine.execution_path import ExecutionPath


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    def summary(self) -> dict[str, float | int | None]:
        itl = self.inter_token_latencies
        return {
            "queue_time_s": self.queue_time,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "itl_p50_s": statistics.median(itl) if itl else None,
            "e2e_s": self.e2e,
            "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": self.num_cached_tokens,
            "generated_tokens": self.num_generated_tokens,
            "preemptions": self.num_preemptions,
        }


@dataclass
class EngineStats:
    """A snapshot of the engine, cheap to take every step."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    # by execution path ("graph", "mixed", ...): [host seconds, steps, tokens] of engine steps, and
    # on CUDA [device seconds, steps] (StepTimes.by_mode, .device_span); the device's idle seconds
    # between chained steps (StepTimes.device_idle). Cumulative since the last counter reset.
    step_host: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    step_device: dict[str, tuple[float, int]] = field(default_factory=dict)
    device_idle_s: float = 0.0
    # steps launched after the step before them was read back at once (StepTimes.read_back_*): how
    # many, the host seconds from each read back to the launch, the device's idle seconds (CUDA)
    read_back_launches: int = 0
    read_back_turnaround_s: float = 0.0
    read_back_idle_s: float = 0.0
    # speculative decoding (engine/speculative.py SpecDecodeStats): verifying steps' drafts
    # proposed and accepted, and accepted drafts by position in their step
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class StepTimes:
    """Where the host time of engine steps went (seconds, summed since the last reset).

    ``forward`` launches the model and the sampling (on the CPU: runs them); ``postprocess``
    reads samples back - on a GPU waiting for the device, with async scheduling for the step
    before this one - and turns them into outputs. The other phases are pure host work.
    """

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    postprocess: float = 0.0
    graph_steps: int = 0  # decode-only steps replayed from CUDA graphs
    graph_forward: float = 0.0
    mixed_steps: int = 0  # decodes + one prefill chunk replayed as one CUDA graph, attention included
    mixed_forward: float = 0.0
    piecewise_steps: int = 0  # steps replayed as piecewise CUDA graphs (attention eager)
    piecewise_forward: float = 0.0
    native_steps: int = 0  # CPU decode-only steps run as one native call (engine/native_decode.py)
    native_forward: float = 0.0
    decode_only_steps: int = 0  # steps with no prefill chunk, and their whole duration and tokens
    decode_only_time: float = 0.0
    decode_only_tokens: int = 0
    # (seconds, requests, tokens), top 5, by host time: with async scheduling a step's host time
    # includes waiting for the step before it, so a short step after a long one ranks high.
    slowest: list[tuple[float, int, int]] = field(default_factory=list)
    # On CUDA, by the step's own device span: (seconds, mode, requests, tokens), top 5.
    slowest_device: list[tuple[float, str, int, int]] = field(default_factory=list)
    # On CUDA: each step's span on the device (its first event to its last, CUDA events) by
    # mode, and the device's idle time between one step's end and the next one's start - the
    # time the host failed to hide.
    device_span: dict[str, list[float]] = field(default_factory=dict)  # mode -> [seconds, steps]
    device_idle: float = 0.0
    # Steps launched after the step before them was read back at once (every step on the CPU; on
    # CUDA a verifying step, or any step without async scheduling) while requests remained: the
    # host's seconds from that read back to this launch, and (CUDA) the device's idle gap between
    # the two steps, which ``device_idle`` leaves out - what a step read back at once costs.
    read_back_launches: int = 0
    read_back_turnaround: float = 0.0
    read_back_idle: float = 0.0
    # mode -> [host seconds of whole steps (schedule to outputs), steps, tokens], every step
    by_mode: dict[str, list[float]] = field(default_factory=dict)

    def record(self, t0: float, t1: float, t2: float, t3: float, t4: float, path: ExecutionPath, requests: int, tokens: int) -> None:
        """Account one step: phase boundaries t0..t4, how the forward ran, batch shape."""
        self.steps += 1
        total = self.by_mode.setdefault(path.value, [0.0, 0, 0])
        total[0] += t4 - t0
        total[1] += 1
        total[2] += tokens
        self.schedule += t1 - t0
        self.prepare += t2 - t1
        self.forward += t3 - t2
        self.postprocess += t4 - t3
        if path is ExecutionPath.GRAPH:
            self.graph_steps += 1
            self.graph_forward += t3 - t2
        elif path is ExecutionPath.MIXED:
            self.mixed_steps += 1
            self.mixed_forward += t3 - t2
        elif path is ExecutionPath.PIECEWISE:
            self.piecewise_steps += 1
            self.piecewise_forward += t3 - t2
        elif path is ExecutionPath.NATIVE:
            self.native_steps += 1
            self.native_forward += t3 - t2
        if requests == tokens:
            self.decode_only_steps += 1
            self.decode_only_time += t4 - t0
            self.decode_only_tokens += tokens
        self.slowest = sorted([*self.slowest, (t4 - t0, requests, tokens)], reverse=True)[:5]

    def record_turnaround(self, seconds: float) -> None:
        """Account one launch after a read back: the host's seconds since that read back."""
        self.read_back_launches += 1
        self.read_back_turnaround += seconds

    def record_device(self, path: ExecutionPath, span: float, idle: float, requests: int = 0, tokens: int = 0,
                      read_back_idle: float = 0.0) -> None:
        """Account one step's device span and the idle gap before it (seconds; ``read_back_idle``
        when the step before it was read back at once), and its batch shape (by the path's name:
        ``device_span`` and ``slowest_device`` hold plain strings)."""
        mode = path.value
        total = self.device_span.setdefault(mode, [0.0, 0])
        total[0] += span
        total[1] += 1
        self.device_idle += idle
        self.read_back_idle += read_back_idle
        self.slowest_device = sorted([*self.slowest_device, (span, mode, requests, tokens)], reverse=True)[:5]

    def device_summary(self) -> dict[str, object]:
        """Busy and idle device seconds, and by mode: seconds and mean ms a step."""
        return {"busy_s": sum(s for s, _ in self.device_span.values()), "idle_s": self.device_idle,
                "read_back_idle_s": self.read_back_idle,
                "by_mode": {mode: {"s": s, "ms_per_step": 1e3 * s / n} for mode, (s, n) in self.device_span.items()}}

    @property
    def decode_rate(self) -> float:
        """Tokens per second over decode-only steps (the steady state of a running batch)."""
        return self.decode_only_tokens / self.decode_only_time if self.decode_only_time else 0.0

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        out = {k: 1e3 * getattr(self, k) / n for k in ("schedule", "prepare", "forward", "postprocess")}
        out["graph_forward"] = 1e3 * self.graph_forward / max(self.graph_steps, 1)
        out["mixed_forward"] = 1e3 * self.mixed_forward / max(self.mixed_steps, 1)
        out["piecewise_forward"] = 1e3 * self.piecewise_forward / max(self.piecewise_steps, 1)
        out["native_forward"] = 1e3 * self.native_forward / max(self.native_steps, 1)
        eager_steps = self.steps - self.graph_steps - self.mixed_steps - self.piecewise_steps - self.native_steps
        eager = self.forward - self.graph_forward - self.mixed_forward - self.piecewise_forward - self.native_forward
        out["eager_forward"] = 1e3 * eager / max(eager_steps, 1)
        return out
