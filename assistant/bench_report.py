"""The voice bench's report: percentiles per caller count, the markdown table, the waterfall PNG,
and the ``results`` object of the JSON file.

Per caller count, ``results`` holds (milliseconds; p50/p95/p99 over the turns that got a timeline):
``endpoint_to_first_audio_ms`` and ``speech_end_to_first_audio_ms`` (the server's timeline),
``client_speech_end_to_first_audio_ms`` (true end of speech to first audio received, at the
client), ``stages`` (each stage's share, see :mod:`assistant.timeline`), ``turns``, ``lost_turns``
(no answer audio or no timeline), ``breakdown`` (where the ASR final's and the first token's time
went: queue, model, hand-off to the event loop), ``event_loop_lag_ms`` (p50/p95/p99 of the server
event loop's lag during the phase, as bucket bounds of ``assistant_event_loop_lag_seconds``),
``gil_wait_ms`` (the same of ``assistant_gil_wait_seconds``: how long a thread waking from a 5 ms
sleep waited to run Python again, as the GPU threads do after each CUDA call) and
``memory_bytes`` (device -> owner -> bytes, from the server's ``/metrics`` after the phase) and
``engine_steps`` (where the engine's time went in the phase, :func:`assistant.bench.engine_steps`:
by execution path the steps, host and device ms a step, tokens a step; the engine thread's and
the GPU's busy shares).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assistant.bench_callers import TurnResult
from assistant.timeline import OPTIONAL_STAGES, STAGES, quantile

QUANTILES = (0.5, 0.9, 0.95, 0.99)
# where the ASR final's and the first token's time went (Timeline.breakdown_ms)
BREAKDOWN = ("asr_queue", "asr_decode", "asr_handoff", "llm_submit", "llm_queue", "llm_prefill", "llm_handoff")
REPORTED = (0.5, 0.95, 0.99)  # in the results object and the table


def summarize(results: list[TurnResult]) -> dict[str, dict[str, float]]:
    """p50/p90/p95/p99 (ms) of every stage share and total, over the turns that got a timeline."""
    series: dict[str, list[float]] = {}
    for r in results:
        t = r.timeline
        if not t:
            continue
        for stage, ms in t["stages_ms"].items():
            series.setdefault(stage, []).append(ms)
        for key in ("speech_end_to_first_audio_ms", "endpoint_to_first_audio_ms"):
            if t.get(key) is not None:
                series.setdefault(key.removesuffix("_ms"), []).append(t[key])
        for part, ms in (t.get("breakdown_ms") or {}).items():
            series.setdefault(part, []).append(ms)
        series.setdefault("uncached_prompt_tokens", []).append(t["prompt_tokens"] - t["cached_tokens"])
        for key in ("partials", "prefills"):
            series.setdefault(key, []).append(t[key])
        for key, value in (("client_s2a", r.client_s2a_ms), ("client_s2a_minus_hangover", r.client_s2a_minus_hangover_ms)):
            if value is not None:
                series.setdefault(key, []).append(value)
        if r.wer is not None:
            series.setdefault("transcript_wer_percent", []).append(100 * r.wer)
    return {k: {f"p{round(q * 100)}": round(quantile(v, q), 1) for q in QUANTILES} | {"n": len(v)}
            for k, v in series.items()}  # fmt: skip


def false_endpoints(results: list[TurnResult]) -> dict[str, dict[str, float]]:
    """False endpoints among the questions asked with a pause and among those spoken whole."""
    out = {}
    for kind, turns in (("paused", [r for r in results if r.pause_ms is not None]), ("whole", [r for r in results if r.pause_ms is None])):
        false = sum(r.false_endpoint for r in turns)
        out[kind] = {"false": false, "n": len(turns), "rate": round(false / len(turns), 3) if turns else None}
    return out


ROWS = (
    ("endpoint", "VAD hangover (speech_end -> endpoint; speculative: -> the turn confirmed)"),
    ("asr_final", "ASR final after endpoint (speculative: after speech_end)"),
    ("asr_queue", "- of which (ASR): waiting in the ASR worker's queue"),
    ("asr_decode", "- of which (ASR): the decode (its batch's time)"),
    ("asr_handoff", "- of which (ASR): after the decode, until the event loop has it"),
    ("response_requested", "client's response.create after ASR final"),
    ("image_read", "the turn's images read after that (OCR)"),
    ("llm_first_token", "LLM first token after ASR final (or response.create)"),
    ("llm_submit", "- of which (LLM): prompt built, request reaches the engine"),
    ("llm_queue", "- of which (LLM): waiting in the engine's queue"),
    ("llm_prefill", "- of which (LLM): prefill to the first token"),
    ("llm_handoff", "- of which (LLM): first token handed to the event loop"),
    ("first_chunk", "first speakable chunk after first token"),
    ("tts_first_audio", "TTS first audio after chunk"),
    ("first_audio_sent", "first audio sent after TTS"),
    ("speech_end_to_first_audio", "server: speech_end -> first audio sent"),
    ("endpoint_to_first_audio", "server: endpoint -> first audio sent (no hangover)"),
    ("client_s2a", "client: end of speech -> first audio received"),
    ("client_s2a_minus_hangover", "client: the same minus the configured hangover"),
    ("transcript_wer_percent", "transcript word error rate (%)"),
    ("uncached_prompt_tokens", "prompt tokens not in the prefix cache (count)"),
    ("partials", "partial transcripts before the final (count)"),
    ("prefills", "early prefills done before the final (count)"),
)


def table(phases: list[dict[str, Any]]) -> str:
    """A markdown table: one row per stage, p50/p95/p99 per phase (an optional stage that no
    turn recorded, such as ``response_requested`` with hands-free callers, has no row)."""
    head = "| stage (ms) | " + " | ".join(f"{title(p)} p50 / p95 / p99" for p in phases) + " |"
    lines = [head, "|---|" + "---|" * len(phases)]
    for key, label in ROWS:
        if (key in OPTIONAL_STAGES or key in BREAKDOWN) and not any(key in p["summary"] for p in phases):
            continue
        cells = []
        for p in phases:
            s = p["summary"].get(key)
            cells.append(f"{s['p50']:.0f} / {s['p95']:.0f} / {s['p99']:.0f}" if s else "n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key, label in (("event_loop_lag_ms", "server event loop lag, 20 ms timer (bucket bound)"),
                       ("gil_wait_ms", "server GIL wait after a 5 ms sleep (bucket bound)")):
        if any(p["results"].get(key) for p in phases):
            lags = [p["results"].get(key) for p in phases]
            lines.append(f"| {label} | " + " | ".join(
                " / ".join("over the top bucket" if g[k] is None else f"{g[k]:g}" for k in ("p50", "p95", "p99")) if g else "n/a"
                for g in lags) + " |")  # fmt: skip
    lines += engine_rows(phases)
    turns = " | ".join(f"{sum(1 for t in p['turns'] if t['timeline'])} of {len(p['turns'])}" for p in phases)
    lines.append(f"| turns with a timeline | {turns} |")
    false = " | ".join(f"{f['paused']['false']} of {f['paused']['n']} / {f['whole']['false']} of {f['whole']['n']}"
                       for f in (p.get("false_endpoints") or _NONE for p in phases))  # fmt: skip
    lines.append(f"| false endpoints: questions with a pause / spoken whole | {false} |")
    return "\n".join(lines)


def engine_rows(phases: list[dict[str, Any]]) -> list[str]:
    """The table's rows for the engine's steps: busy shares, then per execution path the steps
    and their mean host / device ms and tokens (none if no phase has step counters)."""
    steps = [p["results"].get("engine_steps") for p in phases]
    if not any(steps):
        return []

    def share(s: dict[str, Any] | None) -> str:
        if not s:
            return "n/a"
        gpu = "n/a" if s["device_busy"] is None else f"{100 * s['device_busy']:.0f} %"
        return f"{100 * s['host_busy']:.0f} % / {gpu}"

    rows = ["| engine busy in steps: its thread / the GPU (share of the phase) | " + " | ".join(share(s) for s in steps) + " |"]
    for mode in sorted({m for s in steps if s for m in s["by_mode"]}):
        cells = []
        for s in steps:
            m = (s or {}).get("by_mode", {}).get(mode)
            dev = "" if not m or m["device_ms"] is None else f", device {m['device_ms']:g} ms"
            cells.append(f"{m['steps']} steps: host {m['host_ms']:g} ms{dev}, {m['tokens']:g} tokens" if m else "n/a")
        rows.append(f"| engine steps ({mode}), mean a step | " + " | ".join(cells) + " |")
    return rows


_NONE = {"paused": {"false": 0, "n": 0}, "whole": {"false": 0, "n": 0}}


def title(phase: dict[str, Any]) -> str:
    """E.g. "32 caller(s)", "8 caller(s), burst", "32 caller(s), coscheduler off"."""
    extra = [x for x in ("burst" if phase["pattern"] == "burst" else "", phase["server"]) if x]
    return f"{phase['callers']} caller(s)" + "".join(f", {x}" for x in extra)


def plot(phases: list[dict[str, Any]], path: Path) -> None:
    """Waterfall: per caller count, one row per turn with its stage shares stacked from speech_end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = dict(ROWS)
    colors = dict(zip(STAGES[1:], ("#bbbbbb", "#4c72b0", "#937860", "#14b8a6", "#dd8452", "#55a868", "#c44e52", "#8172b3"), strict=True))
    rows = [1 + sum(1 for t in p["turns"] if t["timeline"]) for p in phases]
    fig, axes = plt.subplots(len(phases), 1, figsize=(10, 1.4 + 0.3 * sum(rows) + 0.8 * len(phases)),
                             gridspec_kw={"height_ratios": rows}, squeeze=False)  # fmt: skip
    for ax, phase in zip(axes[:, 0], phases):
        turns = [t for t in phase["turns"] if t["timeline"]]
        medians = {s: phase["summary"][s]["p50"] for s in colors if s in phase["summary"]}
        bars = [("median of each stage", medians)] + [(f"caller {t['caller']} turn {t['turn']}", t["timeline"]["stages_ms"]) for t in turns]
        for y, (_, shares) in enumerate(bars):
            left = 0.0
            for stage, ms in shares.items():
                ax.barh(y, ms / 1000, left=left / 1000, color=colors[stage], edgecolor="white", linewidth=0.5)
                left += ms
        ax.set_yticks(range(len(bars)), [name for name, _ in bars], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{title(phase)}: from the end of speech to the first answer audio sent", fontsize=9)
        ax.set_xlabel("seconds after the end of speech")
        ax.grid(axis="x", alpha=0.3)
    shown = [s for s in colors if s not in OPTIONAL_STAGES or any(s in p["summary"] for p in phases)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in shown]
    fig.legend(handles, [labels[s] for s in shown], loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)




def percentiles(summary: dict[str, dict[str, float]], key: str) -> dict[str, float] | None:
    """{"p50", "p95", "p99"} of ``key`` in a :func:`summarize` result (None: no turn had it)."""
    s = summary.get(key)
    return {f"p{round(q * 100)}": s[f"p{round(q * 100)}"] for q in REPORTED} if s else None


def caller_count_results(turns: list[TurnResult], memory_bytes: dict[str, dict[str, float]],
                         loop_lag_ms: dict[str, float | None] | None = None,
                         gil_wait_ms: dict[str, float | None] | None = None,
                         engine_steps: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One caller count's entry of ``results`` (see the module docstring)."""
    summary = summarize(turns)
    return {
        "endpoint_to_first_audio_ms": percentiles(summary, "endpoint_to_first_audio"),
        "speech_end_to_first_audio_ms": percentiles(summary, "speech_end_to_first_audio"),
        "client_speech_end_to_first_audio_ms": percentiles(summary, "client_s2a"),
        "stages": {stage: percentiles(summary, stage) for stage in STAGES[1:] if stage in summary},
        "breakdown": {part: percentiles(summary, part) for part in BREAKDOWN if part in summary},
        "event_loop_lag_ms": loop_lag_ms,
        "gil_wait_ms": gil_wait_ms,
        "turns": len(turns),
        "lost_turns": sum(t.lost for t in turns),
        "false_endpoints": false_endpoints(turns),
        "memory_bytes": memory_bytes,
        "engine_steps": engine_steps,
    }


def results(config: str, pattern: dict[str, Any], phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON's ``results``: ``callers`` (conversation phases on the server as configured),
    ``burst`` and ``coscheduler_off`` (the same against a server started with it off), each keyed
    by caller count."""
    out: dict[str, Any] = {"config": config, "pattern": pattern, "callers": {}}
    for phase in phases:
        group = "coscheduler_off" if phase["server"] else "burst" if phase["pattern"] == "burst" else "callers"
        out.setdefault(group, {})[str(phase["callers"])] = phase["results"]
    return out
