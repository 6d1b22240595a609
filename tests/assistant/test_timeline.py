"""Per-turn timelines, the stream clock and the Prometheus aggregation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from assistant.timeline import OPTIONAL_STAGES, STAGES, BargeIn, StreamClock, Timeline, TimelineMetrics, quantile

HANDS_FREE = [s for s in STAGES if s not in OPTIONAL_STAGES]  # a turn the server answered on its own


def full_timeline(gaps_ms: list[float], start: float = 100.0, stages: list[str] = HANDS_FREE) -> Timeline:
    timeline = Timeline("voice", hangover_ms=500)
    t = start
    for stage, gap in zip(stages, [0.0, *gaps_ms], strict=True):
        t += gap / 1000
        timeline.mark(stage, t)
    return timeline


@given(
    st.lists(st.floats(0, 5000, allow_nan=False), min_size=len(STAGES), max_size=len(STAGES)),
    st.sets(st.sampled_from(STAGES), min_size=1),
)
def test_shares_of_the_recorded_stages_add_up_to_the_total(gaps: list[float], stages: set[str]) -> None:
    timeline = Timeline()
    t = 1000.0
    for stage, gap in zip(STAGES, gaps):
        t += gap / 1000
        if stage in stages:
            timeline.mark(stage, t)
    shares = timeline.shares_ms()
    recorded = [s for s in STAGES if s in stages]
    assert list(shares) == recorded[1:]
    assert sum(shares.values()) == pytest.approx(timeline.total_ms, abs=1e-9)
    instants = list(timeline.to_dict()["instants_ms"].values())
    assert instants == sorted(instants) and instants[0] == 0.0


def test_totals_with_and_without_the_hangover() -> None:
    timeline = full_timeline([520, 300, 150, 400, 60, 2])
    assert timeline.complete
    report = timeline.to_dict()
    assert report["speech_end_to_first_audio_ms"] == pytest.approx(1432)
    assert report["endpoint_to_first_audio_ms"] == pytest.approx(1432 - 520)
    assert report["stages_ms"] == pytest.approx({"endpoint": 520, "asr_final": 300, "llm_first_token": 150,
                                                 "first_chunk": 400, "tts_first_audio": 60, "first_audio_sent": 2})  # fmt: skip
    assert report["hangover_ms"] == 500 and report["barge_in"] is None


def test_the_wait_for_the_clients_request_is_its_own_share_not_the_llms() -> None:
    """Push to talk: the transcript is ready, the client asks for the answer 1.2 s later."""
    timeline = full_timeline([150, 300, 1200, 140, 400, 60, 2], stages=[s for s in STAGES if s != "image_read"])
    assert timeline.complete
    report = timeline.to_dict()
    assert report["stages_ms"] == pytest.approx({"endpoint": 150, "asr_final": 300, "response_requested": 1200,
                                                 "llm_first_token": 140, "first_chunk": 400, "tts_first_audio": 60,
                                                 "first_audio_sent": 2})  # fmt: skip
    assert report["speech_end_to_first_audio_ms"] == pytest.approx(2252)  # what the user waited, wait included
    assert report["endpoint_to_first_audio_ms"] == pytest.approx(2252 - 150)
    metrics = TimelineMetrics()
    metrics.observe(timeline, "completed")
    metrics.observe(full_timeline([500, 300, 150, 400, 60, 2]), "completed")  # hands free: no request
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples}  # fmt: skip
    assert samples[("assistant_turn_stage_seconds_count", (("stage", "response_requested"),))] == 1
    assert samples[("assistant_turn_stage_seconds_sum", (("stage", "response_requested"),))] == pytest.approx(1.2)
    assert samples[("assistant_turn_stage_seconds_sum", (("stage", "llm_first_token"),))] == pytest.approx(0.29)


def test_a_stage_is_recorded_once_and_must_be_known() -> None:
    timeline = Timeline()
    assert timeline.mark("asr_final", 5.0)
    assert not timeline.mark("asr_final", 6.0)
    assert timeline.instants["asr_final"] == 5.0
    with pytest.raises(ValueError, match="unknown stage"):
        timeline.mark("llm_last_token")
    assert timeline.span_ms("speech_end") is None and not timeline.complete


def test_a_text_turn_without_audio_reports_what_it_has() -> None:
    timeline = Timeline("text")
    for stage in ("speech_end", "endpoint", "asr_final"):
        timeline.mark(stage, 10.0)
    timeline.mark("llm_first_token", 10.25)
    report = timeline.to_dict()
    assert report["total_ms"] == pytest.approx(250) and report["speech_end_to_first_audio_ms"] is None


def test_barge_in_is_reported_from_speech_start_and_from_detection() -> None:
    timeline = full_timeline([500, 300, 100, 300, 50, 1])
    timeline.barge_in = BargeIn(speech_start=50.0, detected=50.09, cancelled=50.092)
    assert timeline.to_dict()["barge_in"] == pytest.approx({"from_speech_start_ms": 92.0, "from_detection_ms": 2.0})


def test_stream_clock_for_a_real_time_client() -> None:
    clock = StreamClock()
    t0 = 1000.0
    for k in range(1, 101):  # 20 ms packets, each arriving when its last sample was spoken
        clock.received(0.02, t0 + 0.02 * k)
    for stream_s in (0.0, 0.013, 0.5, 1.337, 2.0):
        assert clock.at(stream_s) == pytest.approx(t0 + stream_s)
    assert clock.at(5.0) == pytest.approx(t0 + 2.0)  # not heard yet: the latest arrival
    assert clock.position_s == pytest.approx(2.0)


def test_stream_clock_for_a_client_faster_than_real_time() -> None:
    clock = StreamClock()
    for _ in range(50):  # a whole second of audio arrives at once
        clock.received(0.02, 7.0)
    assert clock.at(0.01) == pytest.approx(6.99)  # within the first packet
    assert clock.at(0.9) == 7.0  # never before the packet that carried it could have been sent


def test_stream_clock_keeps_a_bounded_history() -> None:
    clock = StreamClock(keep=10)
    for k in range(1, 1001):
        clock.received(0.01, float(k))
    assert clock.at(9.995) == pytest.approx(999.995)  # still right after old packets were forgotten
    with pytest.raises(ValueError):
        StreamClock().at(0.0)


def test_quantile_interpolates_like_numpy() -> None:
    values = list(np.random.default_rng(0).exponential(size=37))
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert quantile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)))


def test_metrics_export_histograms_and_recent_quantiles() -> None:
    metrics = TimelineMetrics(window=3)
    for asr_ms in (100, 200, 300, 400):
        metrics.observe(full_timeline([500, asr_ms, 100, 300, 50, 1]), "completed")
    cancelled = full_timeline([500, 300, 100, 300, 50, 1])
    cancelled.barge_in = BargeIn(1.0, 1.09, 1.1)
    metrics.observe(cancelled, "cancelled")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples}  # fmt: skip
    assert samples[("assistant_turn_stage_seconds_count", (("stage", "asr_final"),))] == 5
    assert samples[("assistant_turn_stage_seconds_sum", (("stage", "asr_final"),))] == pytest.approx(1.3)
    assert samples[("assistant_turn_total_seconds_count", (("span", "endpoint_to_first_audio"),))] == 5
    assert samples[("assistant_turns_total", (("source", "voice"), ("status", "cancelled")))] == 1
    assert samples[("assistant_barge_in_seconds_count", ())] == 1
    # the window holds the last three turns: asr_final 300, 400, 300 ms
    recent = lambda q: samples[("assistant_turn_stage_recent_seconds", (("quantile", q), ("stage", "asr_final")))]  # noqa: E731
    assert recent("0.5") == pytest.approx(0.3) and recent("0.99") == pytest.approx(quantile([0.3, 0.4, 0.3], 0.99))
    total = samples[("assistant_turn_total_recent_seconds", (("quantile", "0.9"), ("span", "speech_end_to_first_audio")))]
    assert total == pytest.approx(quantile([1.251, 1.351, 1.251], 0.9))


def test_a_speculative_turn_lists_its_stages_in_the_order_they_happened() -> None:
    """A speculative answer is generated before its turn is confirmed: ``endpoint`` comes after
    the TTS stages, every share stays >= 0 and the shares still add up to the total."""
    t = Timeline("voice", 500, endpointing="speculative", endpoint_by="hangover", pause=10.2)
    for stage, at in (("speech_end", 10.0), ("asr_final", 10.35), ("llm_first_token", 10.4), ("first_chunk", 10.42),
                      ("tts_first_audio", 10.45), ("endpoint", 10.5), ("first_audio_sent", 10.51)):  # fmt: skip
        t.mark(stage, at)
    assert list(t.offsets_ms()) == ["speech_end", "asr_final", "llm_first_token", "first_chunk", "tts_first_audio",
                                    "endpoint", "first_audio_sent"]  # fmt: skip
    assert min(t.shares_ms().values()) >= 0 and sum(t.shares_ms().values()) == pytest.approx(t.total_ms)
    report = t.to_dict()
    assert report["pause_ms"] == pytest.approx(200) and report["endpoint_to_first_audio_ms"] == pytest.approx(10)
    assert (report["endpointing"], report["endpoint_by"]) == ("speculative", "hangover")
