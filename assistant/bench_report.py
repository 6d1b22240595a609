"""The voice benchmark's report: the stage table on stdout and the waterfall PNG.

``python -m assistant.bench`` measures (assistant/bench.py); this renders its phases: one row per
stage with p50/p90/p99 per caller count, the turn and false-endpoint counts, and one waterfall row
per turn with its stage shares stacked from speech_end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assistant.timeline import OPTIONAL_STAGES, STAGES

ROWS = (
    ("endpoint", "VAD hangover (speech_end -> endpoint; speculative: -> the turn confirmed)"),
    ("asr_final", "ASR final after endpoint (speculative: after speech_end)"),
    ("response_requested", "client's response.create after ASR final"),
    ("llm_first_token", "LLM first token after ASR final (or response.create)"),
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
    """A markdown table: one row per stage, p50/p90/p99 per caller count (an optional stage that no
    turn recorded, such as ``response_requested`` with hands-free callers, has no row)."""
    head = "| stage (ms) | " + " | ".join(f"{p['callers']} caller(s) p50 / p90 / p99" for p in phases) + " |"
    lines = [head, "|---|" + "---|" * len(phases)]
    for key, label in ROWS:
        if key in OPTIONAL_STAGES and not any(key in p["summary"] for p in phases):
            continue
        cells = []
        for p in phases:
            s = p["summary"].get(key)
            cells.append(f"{s['p50']:.0f} / {s['p90']:.0f} / {s['p99']:.0f}" if s else "n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    turns = " | ".join(f"{sum(1 for t in p['turns'] if t['timeline'])} of {len(p['turns'])}" for p in phases)
    lines.append(f"| turns with a timeline | {turns} |")
    false = " | ".join(f"{f['paused']['false']} of {f['paused']['n']} / {f['whole']['false']} of {f['whole']['n']}"
                       for f in (p.get("false_endpoints") or _NONE for p in phases))  # fmt: skip
    lines.append(f"| false endpoints: questions with a pause / spoken whole | {false} |")
    return "\n".join(lines)


_NONE = {"paused": {"false": 0, "n": 0}, "whole": {"false": 0, "n": 0}}


def plot(phases: list[dict[str, Any]], path: Path) -> None:
    """Waterfall: per caller count, one row per turn with its stage shares stacked from speech_end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = dict(ROWS)
    colors = dict(zip(STAGES[1:], ("#bbbbbb", "#4c72b0", "#937860", "#dd8452", "#55a868", "#c44e52", "#8172b3"), strict=True))
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
        ax.set_title(f"{phase['callers']} concurrent caller(s): from the end of speech to the first answer audio sent", fontsize=9)
        ax.set_xlabel("seconds after the end of speech")
        ax.grid(axis="x", alpha=0.3)
    shown = [s for s in colors if s not in OPTIONAL_STAGES or any(s in p["summary"] for p in phases)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in shown]
    fig.legend(handles, [labels[s] for s in shown], loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["ROWS", "plot", "table"]
