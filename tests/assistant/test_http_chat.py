"""The assistant's OpenAI HTTP routes against a real server on 127.0.0.1: a fresh server's metrics,
the answer's length cap and source line, and the requests refused before anything is scheduled."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from assistant.server import AssistantServer

QUESTION = "How many days of annual leave do I get per year?"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(assistant_server) -> AssistantServer:
    """The server this module shares with test_realtime.py (tests/assistant/conftest.py)."""
    return assistant_server


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)  # type: ignore[attr-defined]


def metrics(server: AssistantServer, text: str | None = None) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) -> value, of ``text`` or else the server's /metrics now."""
    text = text if text is not None else httpx.get(server.url + "/metrics").text  # type: ignore[attr-defined]
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def ask(question: str = QUESTION, **fields) -> dict:
    return {"messages": [{"role": "user", "content": question}], "temperature": 0, **fields}


def post(server: AssistantServer, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + CHAT, content=content, headers={"content-type": "application/json"}, timeout=300, **kw)  # type: ignore[attr-defined]


def wait_idle(server: AssistantServer, timeout: float = 30.0) -> None:
    """Until no request runs or waits (a request another test left finishing would move the counters)."""
    deadline = time.monotonic() + timeout
    while (s := server.answerer.engine.stats()).num_running or s.num_waiting:
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.05)


def test_a_fresh_server_reports_no_request_and_keeps_the_warm_prefix(server, client) -> None:
    m = metrics(server, server.fresh_metrics)  # taken right after the warm-up, before any test asked anything
    for reason in ("stop", "length", "abort"):
        assert m[("vllm:request_success_total", (("finished_reason", reason),))] == 0
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total"):  # fmt: skip
        assert m[(name, ())] == 0, name
    # the warm-up's documents prefix stays in the cache: a question reuses it, and counts once
    wait_idle(server)
    before = metrics(server)
    reply = client.chat.completions.create(model=server.model_name, max_tokens=1, **ask())
    (builder,) = server.answerer.builders.values()  # one handbook language here
    prefix = len(builder.prefix.token_ids)
    assert reply.usage.prompt_tokens_details.cached_tokens >= prefix - 16
    m = metrics(server)
    for key in (("vllm:request_success_total", (("finished_reason", "length"),)), ("vllm:e2e_request_latency_seconds_count", ())):
        assert m[key] == before[key] + 1, key


def test_the_answer_is_capped_at_max_tokens_and_cites_its_source(server, client) -> None:
    whole = [client.chat.completions.create(model=server.model_name, extra_body={"ignore_eos": True}, **ask(**limit))
             for limit in ({}, {"max_tokens": 1000})]  # fmt: skip
    for reply in whole:
        assert reply.usage.completion_tokens == server.config.assistant.max_tokens and reply.choices[0].finish_reason == "length"
    content = whole[0].choices[0].message.content
    assert "\n\nSource: 01-annual-leave.md" in content and content.count("Source:") == 1
    # streamed: the same text, the source line in the last delta, which finishes the answer
    chunks = list(client.chat.completions.create(model=server.model_name, stream=True, extra_body={"ignore_eos": True}, **ask()))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == content
    assert deltas[-1].finish_reason == "length" and deltas[-1].delta.content.endswith(content[content.index("\n\nSource:"):])


def test_an_earlier_answers_source_line_is_not_part_of_the_prompt(server, client) -> None:
    answer = client.chat.completions.create(model=server.model_name, max_tokens=8, **ask()).choices[0].message.content
    assert "\n\nSource: " in answer
    bare = answer[: answer.index("\n\nSource: ")]
    usage = [client.chat.completions.create(model=server.model_name, max_tokens=1, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": earlier},
        {"role": "user", "content": "And in my first year?"}]).usage.prompt_tokens for earlier in (answer, bare)]  # fmt: skip
    assert usage[0] == usage[1]


def test_a_question_the_handbook_does_not_answer_gets_the_refusal_without_the_model(server, client, monkeypatch) -> None:
    """With the refusal gate on, as for a voice turn: the refusal is the answer, streamed or whole,
    and the engine is not asked (no request counted, no completion tokens)."""
    monkeypatch.setattr(server.answerer.config.refusal, "enabled", True)
    wait_idle(server)
    before = metrics(server)
    question = ask("What is the dress code at the office?")
    reply = client.chat.completions.create(model=server.model_name, **question)
    # this folder has no contacts page: the refusal names no contact and cites no section
    assert reply.choices[0].message.content == "The handbook does not say."
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model=server.model_name, stream=True, **question))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == "The handbook does not say." and deltas[-1].finish_reason == "stop"
    after = metrics(server)
    for key in (("vllm:request_success_total", (("finished_reason", "stop"),)), ("vllm:e2e_request_latency_seconds_count", ())):
        assert after[key] == before[key], key
    # a question it answers still goes to the model
    assert client.chat.completions.create(model=server.model_name, max_tokens=2, **ask()).usage.completion_tokens > 0


@pytest.mark.parametrize(
    "body, code, param",
    [
        (ask("\ud800"), "invalid_value", "messages"),  # a lone surrogate: the tokenizer's TypeError was a 500
        (ask(seed=2**64), "invalid_value", "seed"),
        (ask(seed=2**64, stream=True), "invalid_value", "seed"),  # refused before the stream starts
        (ask(stream="yes"), "invalid_type", "stream"),
        (ask("word " * 9000), "context_length_exceeded", "messages"),
    ],
    ids=["lone-surrogate", "seed", "seed-stream", "stream-yes", "context"],
)
def test_bad_chats_get_a_400_and_schedule_nothing(server, body, code, param) -> None:
    wait_idle(server)  # an earlier test's request may still be taking its last step
    before = server.answerer.engine.stats()
    resp = post(server, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param)
    after = server.answerer.engine.stats()
    assert (after.num_steps, after.prefix_cache_queries) == (before.num_steps, before.prefix_cache_queries)


def test_a_body_over_the_limit_gets_a_413(server) -> None:
    resp = post(server, json.dumps(ask("word " * 6_000_000)).encode())  # 30 MB
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/health").status_code == 200  # type: ignore[attr-defined]


def test_metrics_report_memory_by_owner_of_all_three_models(server) -> None:
    """On the CPU: the engine's owners (prefixed "llm") with the ledger's bytes, and where each
    model runs; faster-whisper and hibari report no bytes of their own, so they have no owner row."""
    m = metrics(server)
    ledger = dict(server.answerer.engine.core.memory_rows())
    memory = {labels: value for (name, labels), value in m.items() if name == "assistant_memory_bytes"}
    assert memory[(("device", "cpu"), ("owner", "llm weights"))] == ledger["weights"] > 0
    assert memory[(("device", "cpu"), ("owner", "llm kv_cache"))] == ledger["kv_cache"] > 0
    assert {dict(labels)["owner"] for labels in memory} == {f"llm {owner}" for owner in ledger}
    placed = {dict(labels)["model"]: dict(labels)["device"] for (name, labels), _ in m.items() if name == "assistant_model_device"}
    assert placed == {"llm": "cpu", "asr": "cpu", "tts": "cpu"}
