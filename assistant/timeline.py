"""Per-turn timeline: when each stage of a turn finished, on one clock (``time.perf_counter``).

The stages, in order: ``speech_end`` (the user's last voiced frame), ``endpoint`` (the server
decided the turn is over: with speculative endpointing, when the turn was confirmed, by the
hangover or by the turn-completion rule), ``asr_final``, ``response_requested`` (the client's
``response.create`` arrived; only in a spoken turn the server did not answer on its own, as with
push to talk: see :data:`OPTIONAL_STAGES`), ``image_read`` (the text of the turn's images is ready:
its share is what reading them added to the turn, 0 when they were read while the user was still
typing or speaking; only in a turn with an image), ``llm_first_token``, ``first_chunk`` (first
speakable text handed to TTS), ``tts_first_audio``, ``first_audio_sent``.
Stages are reported in the order they happened (a speculative answer's LLM and TTS stages may
come before its ``endpoint``: its audio waits for the confirmation), in the order above for ties.
A stage's *share* is the time from the previous recorded stage to it, so the shares add up to the
total (first to last recorded instant): the client's wait before asking for the answer is the
share of ``response_requested``, not part of ``llm_first_token``'s. The total is reported with the
VAD hangover (from ``speech_end``) and without it (from ``endpoint``), as the anchors report
voice-to-voice both ways.

Two stages are also split into where their time went (``breakdown_ms``), because under load a
stage can be slow for reasons outside its model: ``asr_final`` into the ASR worker's queue, the
decode, and the hand-off (from the session handing the transcript on to the event loop handling
it); ``llm_first_token`` into the time before the engine had the request (the prompt is built),
the engine's queue, the prefill up to the first token, and the hand-off to the event loop.

:class:`StreamClock` puts instants of the audio stream (seconds of audio received) on the same
clock, and :class:`TimelineMetrics` aggregates finished turns for Prometheus.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

STAGES = (
    "speech_end",
    "endpoint",
    "asr_final",
    "response_requested",
    "image_read",
    "llm_first_token",
    "first_chunk",
    "tts_first_audio",
    "first_audio_sent",
)
# Recorded only in some complete turns: ``response_requested`` only in a spoken turn answered on the
# client's ``response.create`` (push to talk, or server VAD with ``create_response`` off);
# ``image_read`` only in a turn with an image.
OPTIONAL_STAGES = ("response_requested", "image_read")
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class BargeIn:
    """When the user's interrupting speech began, when the VAD knew, and when the reply stopped."""

    speech_start: float
    detected: float
    cancelled: float

    def to_dict(self) -> dict[str, float]:
        return {
            "from_speech_start_ms": _ms(self.cancelled - self.speech_start),
            "from_detection_ms": _ms(self.cancelled - self.detected),
        }


@dataclass
class Timeline:
    """The instants of one turn. ``source`` is "voice", or "text" for a typed turn, whose first
    three instants are all the moment the client asked for the response. A spoken turn that the
    client asked to answer (``response.create`` after the transcript, as with push to talk) stays
    "voice" and records that moment as ``response_requested``."""

    source: str = "voice"
    hangover_ms: int = 0
    instants: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    early_prefill: bool = False
    partials: int = 0  # partial transcripts of the utterance before its final
    prefills: int = 0  # early-prefill requests of the utterance finished before its final
    barge_in: BargeIn | None = None
    endpointing: str = "fixed"  # fixed | speculative (VoiceConfig.endpointing as the server made it concrete)
    endpoint_by: str | None = None  # hangover | completion (the turn-completion rule) | commit (the client)
    pause: float | None = None  # speculative endpointing: when the short pause was heard (the answer then starts)
    images: int = 0  # images in the turn (read by the image stage)
    image_read_ms: float = 0.0  # the image reader's own time for them (cache hits: 0), wherever it overlapped
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # where asr_final's and llm_first_token's time went

    def asr_final_breakdown(self, queue_s: float, decode_s: float, decoded_at: float, handled_at: float) -> None:
        """Split the ASR final: the worker's queue, the decode, and from the decode's end to the
        handler (the worker's bookkeeping, the other results of its batch, the hand-off)."""
        self.breakdown_ms.update(asr_queue=_ms(queue_s), asr_decode=_ms(decode_s),
                                 asr_handoff=_ms(max(0.0, handled_at - decoded_at)))  # fmt: skip

    def first_token_breakdown(self, arrival: float, scheduled: float | None, first_token: float | None,
                              handled_at: float, asked_at: float | None) -> None:  # fmt: skip
        """Split the time to the first token (engine instants, ``time.perf_counter``): before the
        engine had the request (from ``asked_at``), its queue, the prefill, the hand-off."""
        if scheduled is None or first_token is None:
            return
        if asked_at is not None:
            self.breakdown_ms["llm_submit"] = _ms(max(0.0, arrival - asked_at))
        self.breakdown_ms.update(llm_queue=_ms(scheduled - arrival), llm_prefill=_ms(first_token - scheduled),
                                 llm_handoff=_ms(max(0.0, handled_at - first_token)))  # fmt: skip

    def mark(self, stage: str, at: float | None = None) -> bool:
        """Record ``stage`` at ``at`` (default: now) unless already recorded; True if recorded."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")
        if stage in self.instants:
            return False
        self.instants[stage] = time.perf_counter() if at is None else at
        return True

    def recorded(self) -> list[tuple[str, float]]:
        """The recorded (stage, instant) pairs in the order they happened (stage order for ties)."""
        return sorted(((s, self.instants[s]) for s in STAGES if s in self.instants), key=lambda pair: pair[1])

    def offsets_ms(self) -> dict[str, float]:
        """Each recorded stage in ms after the first, rounded to the microsecond (all figures
        below derive from these, so the shares add up to the total exactly)."""
        pairs = self.recorded()
        return {s: _ms(t - pairs[0][1]) for s, t in pairs}

    def shares_ms(self) -> dict[str, float]:
        """Each recorded stage after the first: ms since the previous recorded stage."""
        offsets = list(self.offsets_ms().items())
        return {s: round(t - prev, 3) for (_, prev), (s, t) in zip(offsets, offsets[1:])}

    @property
    def total_ms(self) -> float:
        """First to last recorded instant (the sum of the shares)."""
        offsets = list(self.offsets_ms().values())
        return offsets[-1] if offsets else 0.0

    @property
    def complete(self) -> bool:
        """Every stage recorded, but for the :data:`OPTIONAL_STAGES`, which may be missing."""
        return all(s in self.instants for s in STAGES if s not in OPTIONAL_STAGES)

    def span_ms(self, start: str, end: str = "first_audio_sent") -> float | None:
        """ms from ``start`` to ``end``, or None if either was not recorded."""
        offsets = self.offsets_ms()
        if start not in offsets or end not in offsets:
            return None
        return round(offsets[end] - offsets[start], 3)

    def to_dict(self) -> dict[str, object]:
        """The per-turn report sent to the client (``response.timeline``) and written by the bench."""
        return {
            "source": self.source,
            "stages_ms": self.shares_ms(),
            "instants_ms": self.offsets_ms(),
            "total_ms": self.total_ms,
            "speech_end_to_first_audio_ms": self.span_ms("speech_end"),
            "endpoint_to_first_audio_ms": self.span_ms("endpoint"),
            "hangover_ms": self.hangover_ms,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "early_prefill": self.early_prefill,
            "partials": self.partials,
            "prefills": self.prefills,
            "barge_in": self.barge_in.to_dict() if self.barge_in else None,
            "endpointing": self.endpointing,
            "endpoint_by": self.endpoint_by,
            "pause_ms": self._after_first(self.pause),
            "images": self.images,
            "image_read_ms": self.image_read_ms,
            "breakdown_ms": dict(self.breakdown_ms),
        }

    def _after_first(self, instant: float | None) -> float | None:
        """ms from the first recorded stage to ``instant`` (None if either is missing)."""
        pairs = self.recorded()
        return None if instant is None or not pairs else _ms(instant - pairs[0][1])


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class StreamClock:
    """Maps audio-stream time (seconds of audio received so far) onto ``time.perf_counter``.

    Each received piece of audio is stamped on arrival. A stream instant inside a piece is put at
    the piece's arrival minus the audio after it (a real-time client spoke it then), but never
    before the previous piece arrived (a client sending faster than real time did not).
    """

    def __init__(self, keep: int = 8192) -> None:
        self._ends: list[float] = []
        self._arrivals: list[float] = []
        self._keep = keep
        self.position_s = 0.0

    def received(self, duration_s: float, at: float | None = None) -> None:
        """Stamp the next ``duration_s`` of audio as received at ``at`` (default: now)."""
        self.position_s += duration_s
        self._ends.append(self.position_s)
        self._arrivals.append(time.perf_counter() if at is None else at)
        if len(self._ends) > 2 * self._keep:
            del self._ends[: self._keep], self._arrivals[: self._keep]

    def at(self, stream_s: float) -> float:
        """The process-clock instant of stream time ``stream_s``."""
        if not self._ends:
            raise ValueError("no audio has been received")
        i = bisect.bisect_left(self._ends, stream_s)
        if i >= len(self._ends):
            return self._arrivals[-1]
        estimate = self._arrivals[i] - (self._ends[i] - stream_s)
        return max(estimate, self._arrivals[i - 1]) if i > 0 else estimate


class TimelineMetrics:
    """Prometheus series of finished turns, in their own registry (register it into /metrics).

    Histograms (for ``histogram_quantile`` across servers) of each stage's share and of the two
    totals, and gauges of the p50/p90/p99 over the last ``window`` turns, to read off directly.
    """

    def __init__(self, window: int = 1000) -> None:
        self.registry = CollectorRegistry()
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0)
        self._stage = Histogram(
            "assistant_turn_stage_seconds", "Time from the previous stage of a turn to this one.",
            ("stage",), buckets=buckets, registry=self.registry,
        )  # fmt: skip
        self._total = Histogram(
            "assistant_turn_total_seconds",
            "Turn latency to the first audio sent, from speech_end (with the VAD hangover) or from endpoint.",
            ("span",), buckets=buckets, registry=self.registry,
        )  # fmt: skip
        self._barge_in = Histogram(
            "assistant_barge_in_seconds", "From the start of interrupting speech to the reply stopped.",
            buckets=buckets, registry=self.registry,
        )  # fmt: skip
        self._turns = Counter(
            "assistant_turns", "Finished turns by source and response status.", ("source", "status"),
            registry=self.registry,
        )  # fmt: skip
        self._speculations = Counter(
            "assistant_speculations", "Speculative answers started at a short pause, then confirmed (released) "
            "or cancelled (the user went on: nothing was sent).", ("outcome",), registry=self.registry,
        )  # fmt: skip
        self._false_endpoints = Counter(
            "assistant_false_endpoints", "Answered turns whose user spoke again within the false-endpoint window "
            "of the endpoint (VoiceConfig.false_endpoint_window_ms): the turn was likely not over.",
            registry=self.registry,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._recent: dict[tuple[str, str], deque[float]] = {}
        self.window = window
        self.registry.register(_RecentQuantiles(self))

    def observe(self, timeline: Timeline, status: str) -> None:
        """Record one finished turn (any status: a cancelled turn's recorded stages are real too)."""
        self._turns.labels(timeline.source, status).inc()
        values: list[tuple[str, str, float]] = [("stage", s, ms) for s, ms in timeline.shares_ms().items()]
        for span, start in (("speech_end_to_first_audio", "speech_end"), ("endpoint_to_first_audio", "endpoint")):
            ms = timeline.span_ms(start)
            if ms is not None:
                values.append(("span", span, ms))
        for kind, name, ms in values:
            (self._stage if kind == "stage" else self._total).labels(name).observe(ms / 1000.0)
        if timeline.barge_in is not None:
            self._barge_in.observe(timeline.barge_in.cancelled - timeline.barge_in.speech_start)
        with self._lock:
            for kind, name, ms in values:
                self._recent.setdefault((kind, name), deque(maxlen=self.window)).append(ms / 1000.0)

    def speculation(self, outcome: str) -> None:
        """Count a speculative answer: started, confirmed or cancelled."""
        self._speculations.labels(outcome).inc()

    def false_endpoint(self) -> None:
        """Count an answered turn that the user went on speaking into (see ``_false_endpoints``)."""
        self._false_endpoints.inc()

    def recent(self) -> dict[tuple[str, str], list[float]]:
        """A copy of the recent values per (kind, name), kind "stage" or "span"."""
        with self._lock:
            return {key: list(values) for key, values in self._recent.items()}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class _RecentQuantiles(Collector):
    """Gauges of the p50/p90/p99 over the recent turns, computed at scrape time."""

    NAMES = {"stage": "assistant_turn_stage_recent_seconds", "span": "assistant_turn_total_recent_seconds"}

    def __init__(self, metrics: TimelineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        recent = self._metrics.recent()
        for kind, name in self.NAMES.items():
            what = "stage shares" if kind == "stage" else "totals"
            metric = Metric(name, f"p50/p90/p99 of the last {self._metrics.window} turns' {what}.", "gauge")
            for (k, key), values in sorted(recent.items()):
                if k == kind:
                    for q in QUANTILES:
                        metric.add_sample(name, {kind: key, "quantile": str(q)}, quantile(values, q))
            yield metric
