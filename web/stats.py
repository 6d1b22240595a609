"""The live server panel: sessions, requests, KV cache, prefix cache, memory, recent latencies.

A :class:`ServerSnapshot` is read in-process from the :class:`~assistant.server.AssistantServer`
the page is mounted on (the same numbers ``/metrics`` exports, memory by owner of all three models
included). The prefix hit rate is shown over the whole run and since the
previous snapshot, so a panel refreshed every second or two shows what the cache does now.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from assistant.device_memory import MemoryRow
from assistant.server import AssistantServer
from assistant.timeline import STAGES, quantile

MIB = 1 << 20
SPANS = ("speech_end_to_first_audio", "endpoint_to_first_audio")  # the two totals TimelineMetrics keeps


@dataclass(frozen=True)
class ServerSnapshot:
    sessions: int
    max_sessions: int
    running: int
    waiting: int
    kv_usage: float
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int  # of which found cached
    preemptions: int
    devices: dict[str, str]  # where each model runs: llm, asr, tts
    memory: tuple[MemoryRow, ...]  # the LLM's ledger and the ASR's memory, by owner and device
    process_rss: int  # bytes of CPU memory held by this process (all three models and the rest)
    recent: tuple[tuple[str, float, float, int], ...]  # (span or stage, p50 s, p90 s, turns) over recent turns

    @classmethod
    def take(cls, server: AssistantServer) -> ServerSnapshot:
        engine = server.answerer.engine
        stats = engine.stats()
        by_name = {name: values for (_, name), values in server.timelines.recent().items()}
        order = [*SPANS, *STAGES]
        recent = tuple(
            (name, quantile(values, 0.5), quantile(values, 0.9), len(values))
            for name, values in sorted(by_name.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
        )  # fmt: skip
        return cls(
            sessions=len(server.sessions), max_sessions=server.config.max_sessions,
            running=stats.num_running, waiting=stats.num_waiting, kv_usage=stats.kv_usage,
            kv_blocks_used=stats.kv_blocks_total - stats.kv_blocks_free, kv_blocks_total=stats.kv_blocks_total,
            prefix_queries=stats.prefix_cache_queries, prefix_hits=stats.prefix_cache_hits,
            preemptions=stats.num_preemptions, devices=server.models.devices(), memory=tuple(server.models.memory_rows()),
            process_rss=_rss_bytes(),
            recent=recent,
        )  # fmt: skip

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def hit_rate_since(self, before: ServerSnapshot | None) -> float | None:
        """Prefix hit rate of the prompt tokens looked up since ``before`` (None: none looked up)."""
        if before is None:
            return None
        queries = self.prefix_queries - before.prefix_queries
        return (self.prefix_hits - before.prefix_hits) / queries if queries > 0 else None

    def markdown(self, before: ServerSnapshot | None = None) -> str:
        """The panel: a table of the live numbers, memory by owner, and recent p50/p90 latencies."""
        now = self.hit_rate_since(before)
        lines = [
            "| live | |", "|---|---|",
            f"| sessions | {self.sessions} / {self.max_sessions} |",
            f"| requests running / waiting | {self.running} / {self.waiting} |",
            f"| KV cache usage | {self.kv_usage:.1%} ({self.kv_blocks_used} / {self.kv_blocks_total} blocks) |",
            f"| prefix hit rate | {self.hit_rate:.1%} since start" + (f" · {now:.1%} lately" if now is not None else "") + " |",
            f"| preemptions | {self.preemptions} |",
            "", "**Memory** (" + ", ".join(f"{model.upper()} on {device}" for model, device in self.devices.items()) + ")", "",
            "| owner | device | MiB |", "|---|---|---:|",
            *(f"| {row.owner} | {row.device} | {row.nbytes / MIB:,.1f} |" for row in self.memory),
            f"| this process (resident, all models) | cpu | {self.process_rss / MIB:,.1f} |",
        ]  # fmt: skip
        if self.recent:
            lines += ["", "**Recent turns, all sessions** (ms)", "", "| total or stage | p50 | p90 | turns |", "|---|---:|---:|---:|"]
            lines += [f"| {name.replace('_', ' ')} | {p50 * 1000:.0f} | {p90 * 1000:.0f} | {n} |" for name, p50, p90, n in self.recent]
        return "\n".join(lines)


def _rss_bytes() -> int:
    """Resident memory of this process (Linux ``/proc``; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
