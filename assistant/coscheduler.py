"""The co-scheduler: the ASR worker, the engine and the TTS worker ordered by turn urgency.

A voice turn is urgent from its endpoint until its first audio. It waits for its ASR final, then
for its LLM first token, then for its first TTS audio; the pipeline says which (:meth:`CoScheduler.waits`)
at those timeline instants, and the co-scheduler counts the turns at each stage. From the counts
and its mode it makes the hooks each part is built with (engine and speech know nothing of it):

========================  ==================================================  =========================
part                      on                                                  off
========================  ==================================================  =========================
ASR worker                finals before partials, sessions round robin;       arrival order; partials
(``ASRQueuePolicy``)      partials only with spare capacity                   as configured
Whisper's CUDA stream     high priority (``ASRConfig.cuda_stream_priority``)  default
engine priority           a turn's request above every other (VOICE_TURN)     all requests alike (0)
engine step bound         while a turn waits for its final or first token,    none
(``StepBound``)           other requests share ``step_tokens`` a step
TTS worker                a reply's first piece before later pieces           arrival order
early prefill             only with spare capacity                            as configured
========================  ==================================================  =========================

Spare capacity: no turn waits for its ASR final or its first token. A partial decode or an early
prefill then takes nothing an urgent turn needs; while one waits, partials are skipped (the next
one catches up) and early prefills are not started. Turns waiting for first audio do not count:
by then the GPU work of the turn is done. Early prefill stays in the default class (0), with no
precedence over other requests. Off is each part on its own, first come first served, for an
A/B in the same run. The counts are Prometheus gauges in both modes (:attr:`CoScheduler.registry`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum

from prometheus_client import CollectorRegistry, Gauge

from assistant.config import VoiceConfig
from engine.scheduler import StepBound
from engine.serving.openai_protocol import PRIORITY_RANGE
from speech.asr.worker import ASRQueuePolicy

VOICE_TURN = PRIORITY_RANGE[0]  # a Realtime turn's engine priority when on: the most urgent class there is
DEFAULT_PRIORITY = 0  # every other request's (HTTP chats by default, early prefill), and every request's when off


class Wait(Enum):
    """What an urgent turn waits for."""

    ASR_FINAL = "asr_final"  # endpointed, its final transcript not out yet
    FIRST_TOKEN = "first_token"  # its reply started, no token yet
    FIRST_AUDIO = "first_audio"  # tokens out, no audio yet


@dataclass(frozen=True)
class UrgentCounts:
    """How many turns wait at each stage now."""

    asr_final: int = 0
    first_token: int = 0
    first_audio: int = 0


class CoScheduler:
    """Counts the urgent turns and hands out the hooks the module docstring lists; thread-safe
    (the pipeline calls it on the event loop, the ASR worker and the engine on their threads)."""

    def __init__(self, enabled: bool = VoiceConfig.coscheduler, step_tokens: int = VoiceConfig.coscheduler_step_tokens) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.enabled = enabled
        self.step_tokens = step_tokens
        self._lock = threading.Lock()
        self._turns: dict[tuple[str, str], Wait] = {}  # (session, turn) -> what it waits for
        self._counts = dict.fromkeys(Wait, 0)
        self.registry = CollectorRegistry()
        waiting = Gauge("assistant_coscheduler_turns_waiting", "Turns waiting for their ASR final, LLM first token "
                        "or first audio (the co-scheduler's urgency counts).", ["stage"], registry=self.registry)  # fmt: skip
        for stage in Wait:
            waiting.labels(stage.value).set_function(lambda stage=stage: self._counts[stage])
        Gauge("assistant_coscheduler_enabled", "1 when the co-scheduler orders the work, 0 when each part runs "
              "first come first served.", registry=self.registry).set(int(enabled))  # fmt: skip

    @classmethod
    def from_config(cls, config: VoiceConfig) -> CoScheduler:
        return cls(config.coscheduler, config.coscheduler_step_tokens)

    # ---- the pipeline's side ---------------------------------------------------------------------
    def waits(self, session: str, turn: str, stage: Wait | None) -> None:
        """Turn ``turn`` of ``session`` now waits for ``stage`` (None: for nothing urgent)."""
        with self._lock:
            previous = self._turns.pop((session, turn), None)
            if previous is not None:
                self._counts[previous] -= 1
            if stage is not None:
                self._turns[(session, turn)] = stage
                self._counts[stage] += 1

    def end_session(self, session: str) -> None:
        """Forget every turn of a closed session."""
        with self._lock:
            for key in [key for key in self._turns if key[0] == session]:
                self._counts[self._turns.pop(key)] -= 1

    def snapshot(self) -> UrgentCounts:
        with self._lock:
            return UrgentCounts(*(self._counts[stage] for stage in Wait))

    # ---- the hooks ---------------------------------------------------------------------------------
    def spare_capacity(self) -> bool:
        """Room for partials and early prefill: always when off; when on, while no turn waits for
        its ASR final or its first token."""
        return not self.enabled or not (self._counts[Wait.ASR_FINAL] or self._counts[Wait.FIRST_TOKEN])

    def step_bound(self) -> StepBound | None:
        """The engine's bound for its next step (called on the engine thread once a step)."""
        if self.spare_capacity():
            return None
        return StepBound(priority=VOICE_TURN, tokens=self.step_tokens)

    @property
    def turn_priority(self) -> int:
        """The engine priority of a Realtime session's reply."""
        return VOICE_TURN if self.enabled else DEFAULT_PRIORITY

    def asr_policy(self) -> ASRQueuePolicy:
        return ASRQueuePolicy(urgent_first=True, spare_capacity=self.spare_capacity) if self.enabled else ASRQueuePolicy(urgent_first=False)

    @property
    def cuda_stream_priority(self) -> str:
        """Whisper's CUDA stream (``ASRConfig.cuda_stream_priority``)."""
        return "high" if self.enabled else "default"


__all__ = ["DEFAULT_PRIORITY", "VOICE_TURN", "CoScheduler", "UrgentCounts", "Wait"]
