"""The co-scheduler on its own: the urgency counts the pipeline keeps, and the hooks it hands the
engine and the speech workers in each mode (the hooks' effect is tested where each part is:
tests/engine/test_step_bound.py, tests/speech/test_queue_policy.py; the pipeline's side in
tests/assistant/test_pipeline.py)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from assistant.config import ServerConfig, VoiceConfig
from assistant.coscheduler import DEFAULT_PRIORITY, VOICE_TURN, CoScheduler, UrgentCounts, Wait
from assistant.serve_command import parse_config
from engine.scheduler import StepBound


def test_a_turn_is_counted_at_one_stage_at_a_time_and_a_closed_session_is_forgotten() -> None:
    co = CoScheduler()
    co.waits("s1", "item_a", Wait.ASR_FINAL)
    co.waits("s2", "item_b", Wait.ASR_FINAL)
    assert co.snapshot() == UrgentCounts(asr_final=2)
    co.waits("s1", "item_a", None)  # its final is out
    co.waits("s1", "resp_a", Wait.FIRST_TOKEN)
    assert co.snapshot() == UrgentCounts(asr_final=1, first_token=1)
    co.waits("s1", "resp_a", Wait.FIRST_AUDIO)
    co.waits("s1", "resp_a", Wait.FIRST_AUDIO)  # said twice: still one turn
    assert co.snapshot() == UrgentCounts(asr_final=1, first_audio=1)
    co.waits("s1", "resp_a", None)
    co.waits("s1", "resp_a", None)  # a turn that waits for nothing may be told so again
    co.end_session("s2")
    assert co.snapshot() == UrgentCounts()


def test_spare_capacity_and_the_step_bound_follow_the_urgent_turns_when_on() -> None:
    co = CoScheduler(enabled=True, step_tokens=128)
    assert co.spare_capacity() and co.step_bound() is None
    for stage in (Wait.ASR_FINAL, Wait.FIRST_TOKEN):
        co.waits("s", "t", stage)
        assert not co.spare_capacity()
        assert co.step_bound() == StepBound(priority=VOICE_TURN, tokens=128)
    co.waits("s", "t", Wait.FIRST_AUDIO)  # the turn's GPU work is done: partials may run again
    assert co.spare_capacity() and co.step_bound() is None
    assert co.turn_priority == VOICE_TURN < DEFAULT_PRIORITY
    policy = co.asr_policy()
    assert policy.urgent_first and policy.spare_capacity() is True
    co.waits("s", "t2", Wait.ASR_FINAL)
    assert policy.spare_capacity() is False  # the worker's hook reads the live counts
    assert co.cuda_stream_priority == "high"


def test_off_leaves_each_part_on_its_own() -> None:
    co = CoScheduler(enabled=False)
    co.waits("s", "t", Wait.ASR_FINAL)
    co.waits("s", "r", Wait.FIRST_TOKEN)
    assert co.snapshot() == UrgentCounts(asr_final=1, first_token=1)  # still counted, for the A/B
    assert co.spare_capacity() and co.step_bound() is None
    assert co.turn_priority == DEFAULT_PRIORITY
    assert not co.asr_policy().urgent_first and co.asr_policy().spare_capacity()
    assert co.cuda_stream_priority == "default"


def test_the_counts_are_prometheus_gauges() -> None:
    co = CoScheduler(enabled=False)
    co.waits("s", "t", Wait.FIRST_TOKEN)
    text = generate_latest(co.registry).decode()
    assert 'assistant_coscheduler_turns_waiting{stage="first_token"} 1.0' in text
    assert 'assistant_coscheduler_turns_waiting{stage="asr_final"} 0.0' in text
    assert "assistant_coscheduler_enabled 0.0" in text


def test_the_command_line_switches_it_and_the_config_checks_the_bound() -> None:
    assert parse_config(["serve"])[0].voice.coscheduler is True
    assert parse_config(["serve", "--coscheduler", "off"])[0].voice.coscheduler is False
    assert CoScheduler.from_config(VoiceConfig(coscheduler=False, coscheduler_step_tokens=64)).step_tokens == 64
    with pytest.raises(ValueError, match="coscheduler_step_tokens"):
        ServerConfig(voice=VoiceConfig(coscheduler_step_tokens=0)).validate()
