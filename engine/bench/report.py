"""The report: a row per figure against its ceiling or baseline, and the sections printed under the table."""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.metrics import StepTimes


@dataclass
class Row:
    """One figure of the report, against its ceiling or baseline (``ref_value``)."""

    figure: str
    value: float
    unit: str
    reference: str = ""
    ref_value: float | None = None
    higher_is_better: bool = True
    is_check: bool = False  # a pass/fail bound, not a comparison

    @property
    def ratio(self) -> float | None:
        """value / reference (a fraction of a ceiling, or a multiple of a baseline)."""
        if not self.ref_value:
            return None
        return self.value / self.ref_value

    def verdict(self) -> str:
        r = self.ratio
        if r is None:
            return ""
        if self.is_check:
            return "pass" if self.value <= self.ref_value else "FAIL"
        if not self.higher_is_better and r < 1:
            return f"{1 / r:.1f}x lower"
        return f"{r:.2f}x"


def slowest_steps(st: StepTimes) -> str:
    """The five slowest steps: by their device spans where recorded (CUDA), else by host time
    (which, with async scheduling, includes waiting for the step before)."""
    if st.slowest_device:
        return f"slowest steps on the device (s, mode, requests, tokens): {[(round(a, 3), m, r, t) for a, m, r, t in st.slowest_device]}"
    return f"slowest steps by host time (s, requests, tokens): {[(round(a, 3), r, t) for a, r, t in st.slowest]}"


def format_device_time(device_time: dict[str, dict]) -> str:
    """The report's device-time section from each suite's ``StepTimes.device_summary()``."""
    lines = ["\nwhere the device time went (CUDA events around each step: seconds of step spans by mode, mean ms a "
             "step; idle: with async scheduling, gaps between a step and the one launched behind it that the host did not hide; "
             "after read backs: gaps after a step the host waited for, until it launched the next):"]
    for suite, d in device_time.items():
        lines.append(f"  {suite:<11} busy {d['busy_s']:.2f} s, idle {d['idle_s']:.2f} s, after read backs {d['read_back_idle_s']:.2f} s;  "
                     + "  ".join(f"{m} {t['s']:.2f} s ({t['ms_per_step']:.2f} ms/step)" for m, t in sorted(d["by_mode"].items())))
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's and its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def format_table(rows: list[Row]) -> str:
    """The report's table: each figure, its reference and their ratio."""
    lines = [f"{'figure':<78} {'value':>12} {'unit':<10} {'ceiling / baseline':<44} {'ref':>12} {'ratio':>11}"]
    for r in rows:
        ref = f"{r.ref_value:,.2f}" if r.ref_value is not None else ""
        lines.append(f"{r.figure:<78} {r.value:>12,.2f} {r.unit:<10} {r.reference:<44} {ref:>12} {r.verdict():>11}")
    return "\n".join(lines)


def engine_settings(config: EngineConfig) -> dict[str, float]:
    """What the JSON record says about an engine the suites ran on."""
    return {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "gpu_memory_utilization": config.gpu_memory_utilization}
