"""Where the time of a turn went: the ``response.timeline`` report as a waterfall and as a table.

Each stage of a turn is a bar from the previous recorded instant to its own,
so the bars add up to the whole turn. The summary line gives the two totals of a spoken turn (from
the end of speech, with the VAD hangover, and from the endpoint, without it) and the prompt tokens
with how many came from the prefix cache.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from assistant.timeline import STAGES

LABELS = {
    "speech_end": "speech end",
    "endpoint": "VAD endpoint",
    "asr_final": "ASR final",
    "response_requested": "answer requested",
    "image_read": "image read",
    "llm_first_token": "LLM first token",
    "first_chunk": "first chunk",
    "tts_first_audio": "TTS first audio",
    "first_audio_sent": "audio sent",
}
COLORS = {
    "speech_end": "#9ca3af",
    "endpoint": "#f59e0b",
    "asr_final": "#10b981",
    "response_requested": "#a3a3a3",
    "image_read": "#14b8a6",
    "llm_first_token": "#6366f1",
    "first_chunk": "#8b5cf6",
    "tts_first_audio": "#ec4899",
    "first_audio_sent": "#0ea5e9",
}


def stages(timeline: dict[str, Any]) -> list[str]:
    """The stages that happened: a typed turn has no speech, so its timing starts at LLM work."""
    heard = ("speech_end", "endpoint", "asr_final")
    return [s for s in STAGES if s in timeline["instants_ms"] and not (timeline["source"] == "text" and s in heard)]


def summary(timeline: dict[str, Any]) -> str:
    """One line: the totals and the tokens of the turn."""
    parts = [f"{timeline['source']} turn"]
    if timeline["source"] == "voice" and timeline.get("speech_end_to_first_audio_ms") is not None:
        parts.append(f"speech end → first audio {timeline['speech_end_to_first_audio_ms']:.0f} ms "
                     f"(endpoint → first audio {timeline['endpoint_to_first_audio_ms']:.0f} ms, hangover {timeline['hangover_ms']} ms)")  # fmt: skip
    else:
        parts.append(f"total {timeline['total_ms']:.0f} ms")
    parts.append(f"prompt {timeline['prompt_tokens']} tokens, {timeline['cached_tokens']} cached")
    return " · ".join(parts)


def figure(timeline: dict[str, Any]) -> Figure:
    """A horizontal waterfall: one bar per recorded stage, from the previous instant to its own."""
    instants: dict[str, float] = timeline["instants_ms"]
    shown = stages(timeline)
    fig = Figure(figsize=(8.0, 3.2), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    previous = 0.0
    total = max(instants.values(), default=0.0) or 1.0
    for row, stage in enumerate(shown):
        at = instants[stage]
        ax.barh(row, max(at - previous, total * 0.003), left=previous, color=COLORS[stage], height=0.6)
        ax.text(at + total * 0.01, row, f"{at - previous:.0f} ms", va="center", fontsize=8)
        previous = at
    ax.set_yticks(range(len(shown)), [LABELS[s] for s in shown], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, total * 1.18)
    ax.set_xlabel("ms since the end of speech" if timeline["source"] == "voice" else "ms since the question was sent", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"total {timeline['total_ms']:.0f} ms · prompt {timeline['prompt_tokens']} tokens "
                 f"({timeline['cached_tokens']} cached)", fontsize=10)  # fmt: skip
    return fig


def table(turns: list[tuple[int, dict[str, Any]]]) -> str:
    """A Markdown table, one row per turn (numbered), of each stage's share in ms and the tokens
    ("–": the stage did not happen: no speech in a typed turn, no audio in a text answer, no
    request for the answer in a hands-free turn, which the server answers on its own)."""
    head = "| turn | source | " + " | ".join(LABELS[s] for s in STAGES[1:]) + " | total | prompt / cached tokens |"
    rule = "|" + "---|" * (len(STAGES) + 3)
    rows = []
    for number, tl in turns:
        shares, happened = tl["stages_ms"], stages(tl)
        cells = [f"{shares[s]:.0f}" if s in shares and s in happened else "–" for s in STAGES[1:]]
        rows.append(f"| {number} | {tl['source']} | " + " | ".join(cells)
                    + f" | {tl['total_ms']:.0f} | {tl['prompt_tokens']} / {tl['cached_tokens']} |")  # fmt: skip
    return "\n".join([head, rule, *rows])
