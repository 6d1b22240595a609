"""The OpenAI-compatible server, driven by the official openai SDK against a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from engine import LLM, AsyncEngine, SamplingParams, build_engine
from engine.llm import make_config
from engine.serving.cli import parse_settings
from engine.serving.server import MAX_BODY_BYTES, BackgroundServer, create_app
from tests.engine.helpers import wait_idle

MODEL = "smollm2-test"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello in Spanish.",
             "What do bees make?", "What is ice made of?", "Which planet is red?", "What do cows drink?"]


@pytest.fixture(scope="module")
def engine(smollm, llm_gguf_path):
    eng = AsyncEngine(core=build_engine(make_config(str(llm_gguf_path), num_kv_blocks=1024, max_num_seqs=64), smollm))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(smollm, llm_gguf_path):
    return LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=256)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = user("hi")




# ---- routes ----------------------------------------------------------------------------------------
def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_uses_the_chat_template_and_streaming_matches_whole(client, offline):
    params = dict(model=MODEL, messages=user(QUESTIONS[0]), max_tokens=12, temperature=0)
    expected = offline.chat(user(QUESTIONS[0]), SamplingParams(temperature=0, max_tokens=12))[0]
    whole = client.chat.completions.create(**params)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1  # really streamed, token by token
    assert "".join(content) == expected.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_sse_wire_format(server):
    body = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert {p["object"] for p in payloads} == {"text_completion"}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["usage"] is None for p in payloads)  # no usage chunk unless asked for


def test_completions_text_and_token_id_prompts_agree(client, offline):
    ids = offline.tokenizer.encode("The capital of France is")
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    expected = offline.generate(ids, SamplingParams(temperature=0, max_tokens=6))[0]
    assert by_text.choices[0].text == by_ids.choices[0].text == expected.text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)


def test_developer_role_text_parts_max_completion_tokens_and_default_model(server, offline):
    messages = [{"role": "developer", "content": "Answer in one word."},
                {"role": "user", "content": [{"type": "text", "text": "What colour is the sky?"}]}]
    expected = offline.chat([{"role": "system", "content": "Answer in one word."}, *user("What colour is the sky?")],
                            SamplingParams(temperature=0, max_tokens=5))[0]
    resp = httpx.post(server.url + CHAT, json={"messages": messages, "max_completion_tokens": 5, "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == MODEL
    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


def test_max_tokens_and_ignore_eos(client):
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 7
    assert out.choices[0].finish_reason == "length"


def test_stop_strings_end_the_answer_without_the_stop(client, offline):
    full = offline.chat(user(QUESTIONS[0]), SamplingParams(temperature=0, max_tokens=12))[0].text
    stop = full.split()[3]  # a word in the middle of the greedy answer
    kw = dict(model=MODEL, messages=user(QUESTIONS[0]), max_tokens=12, temperature=0, stop=[stop])
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.content == full[: full.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content


def test_stop_token_ids_and_vllm_sampling_fields(client, offline):
    ids = offline.tokenizer.encode("Once upon a time")
    greedy = offline.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    stop_id = greedy[3]
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [stop_id], "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.0, "ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop_id
    assert out.usage.completion_tokens == greedy.index(stop_id) + 1


def test_logprobs_chat_and_completions(client):
    chat = client.chat.completions.create(model=MODEL, messages=user(QUESTIONS[1]), max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].token == tok.token and tok.top_logprobs[0].logprob == pytest.approx(tok.logprob)  # greedy
        assert tok.bytes == list(tok.token.encode())
    assert "".join(t.token for t in content) == chat.choices[0].message.content

    comp = client.completions.create(model=MODEL, prompt="Red, green and", max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 3
    assert all(tok in alts and len(alts) == 2 for tok, alts in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(3)]


def test_usage_counts_cached_prompt_tokens(client, engine):
    prompt = list(range(1000, 1000 + 70))  # 70 tokens: 4 full blocks of 16 may be cached
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    assert second.usage.prompt_tokens == 70


async def test_concurrent_clients_each_get_their_own_answer_and_the_loop_stays_free(aclient, offline, server):
    expected = [o.text for o in offline.chat([user(q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=10))]
    latencies = []

    async def ping(http: httpx.AsyncClient, done: asyncio.Event) -> None:
        while not done.is_set():
            t = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - t)
            await asyncio.sleep(0.02)

    async def ask(i: int) -> str:
        if i % 2:
            r = await aclient.chat.completions.create(model=MODEL, messages=user(QUESTIONS[i]), max_tokens=10, temperature=0)
            return r.choices[0].message.content
        stream = await aclient.chat.completions.create(model=MODEL, messages=user(QUESTIONS[i]), max_tokens=10, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=server.url) as http:
        pinger = asyncio.create_task(ping(http, done))
        answers = await asyncio.gather(*(ask(i) for i in range(len(QUESTIONS))))
        done.set()
        await pinger
    assert answers == expected
    assert len(latencies) > 10 and max(latencies) < 0.5  # handlers never wait on model work


# ---- clients that go away ------------------------------------------------------------------------
async def test_fifty_streaming_clients_disconnect_mid_answer_and_free_the_kv_pool(aclient, engine):
    await wait_idle(engine)
    before = engine.stats()

    async def read_then_leave(i: int) -> int:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=user(f"{i}: tell me a long story about the sea."), max_tokens=2000, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )
        got = 0
        async for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got == 1 + i % 3:  # some leave after one token, some later
                break
        await stream.close()
        return got

    got = await asyncio.gather(*(read_then_leave(i) for i in range(50)))
    assert all(g >= 1 for g in got)
    after = await wait_idle(engine, timeout=60)
    assert after.kv_blocks_free == after.kv_blocks_total
    assert after.num_running == 0 and after.num_waiting == 0
    # Aborted, not run to the end: 50 x 2000 tokens would take far longer than the wait above.
    assert after.generation_tokens - before.generation_tokens < 50 * 100


async def test_non_streaming_client_that_times_out_aborts_its_request(server, engine):
    before = await wait_idle(engine)
    body = {"model": MODEL, "prompt": "Write an essay.", "max_tokens": 2000, "ignore_eos": True}
    # 3 s: long enough for a first token on a loaded 2-core machine (1 s was not, under a parallel
    # model load), far too short for 2000 tokens
    async with httpx.AsyncClient(base_url=server.url, timeout=3.0) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body)
    after = await wait_idle(engine, timeout=15)
    assert 0 < after.generation_tokens - before.generation_tokens < 2000


# ---- bad requests --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "route, body, status, code, param, message",
    [
        (CHAT, b'{"model": "x", "messages": [', 400, "invalid_json", None, "not valid JSON"),
        (CHAT, b"", 400, "invalid_json", None, "missing"),
        (CHAT, b"[1, 2]", 400, "invalid_json", None, "JSON object"),
        (CHAT, b"[" * 50_000, 400, "invalid_json", None, "parsing the body"),  # too deep for the JSON parser
        (CHAT, {"model": "gpt-4o", "messages": HI}, 404, "model_not_found", "model", "gpt-4o"),
        (COMPLETIONS, {"model": "gpt-4o", "prompt": "hi"}, 404, "model_not_found", "model", "does not exist"),
        (COMPLETIONS, {"model": MODEL, "prompt": list(range(5, 9000))}, 400, "context_length_exceeded", "prompt", "maximum context length is 8192"),
        (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 8190}, 400, "context_length_exceeded", "messages", "maximum context length"),
        (CHAT, {"model": MODEL, "messages": HI, "temperature": -1}, 400, "invalid_value", "temperature", "temperature must be in [0, 100]"),
        (CHAT, {"model": MODEL, "messages": HI, "top_p": 0}, 400, "invalid_value", "top_p", "top_p must be in (0, 1]"),
        (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 0}, 400, "invalid_value", "max_tokens", "max_tokens must be"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "top_k": -3}, 400, "invalid_value", "top_k", "top_k must be"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "invalid_value", "repetition_penalty", "repetition_penalty must be > 0"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "stop_token_ids": [10**7]}, 400, "invalid_value", "stop_token_ids", "vocab size"),
        (COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "invalid_value", "prompt", "prompt token ids"),
        (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "invalid_value", "prompt", "empty"),
        (CHAT, {"model": MODEL, "messages": HI, "temperature": "hot"}, 400, "invalid_type", "temperature", "valid number"),
        (CHAT, {"model": MODEL, "messages": []}, 400, "invalid_type", "messages", "at least 1"),
        (CHAT, {"model": MODEL}, 400, "missing_required_parameter", "messages", "messages"),
        (CHAT, {"model": MODEL, "messages": HI, "beam_width": 4}, 400, "unknown_parameter", "beam_width", "Unrecognized"),
        (CHAT, {"model": MODEL, "messages": HI, "n": 2}, 400, "unsupported_value", "n", "n=2 is not supported"),
        (CHAT, {"model": MODEL, "messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_value", "tools", "tools"),
        (COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, 400, "unsupported_value", "prompt", "batch of 2"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "echo": True}, 400, "unsupported_value", "echo", "echo"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "suffix": "!"}, 400, "unsupported_value", "suffix", "suffix"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "unsupported_value", "best_of", "best_of=3"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "unsupported_value", "logit_bias", "logit_bias"),
        (CHAT, {"model": MODEL, "messages": HI, "response_format": {"type": "json_object"}}, 400, "unsupported_value", "response_format", "text"),
        (CHAT, {"model": MODEL, "messages": HI, "tool_choice": "required"}, 400, "unsupported_value", "tool_choice", "no tools"),
        (CHAT, {"model": MODEL, "messages": HI, "top_logprobs": 2}, 400, None, "top_logprobs", "requires logprobs"),
        (CHAT, {"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}}, 400, None, "stream_options", "only allowed when stream"),
        (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_type", "messages", "role"),
        # the engine alone takes no images (the assistant's server reads them: tests/assistant/test_realtime.py)
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "unsupported_content", "messages", "takes no images"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400, "invalid_type", "messages", "content"),
        # a lone surrogate is valid JSON but not text: the tokenizer (and the UTF-8 encoder) refuse it
        (CHAT, {"model": MODEL, "messages": user("\ud800")}, 400, "invalid_value", "messages", "'messages.0.content'"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]}, 400, "invalid_value", "messages", "lone UTF-16 surrogate"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi \ud800"}, 400, "invalid_value", "prompt", "'prompt'"),
        (CHAT, {"model": "\ud800", "messages": HI}, 400, "invalid_value", "model", "lone UTF-16 surrogate"),
        (CHAT, {"model": MODEL, "messages": HI, "stop": ["\udc00"]}, 400, "invalid_value", "stop", "'stop.0'"),
        (CHAT, {"model": MODEL, "messages": HI, "\ud800": 1}, 400, "invalid_value", "\\ud800", "lone UTF-16 surrogate"),
        # OpenAI's seed is a 64-bit signed integer; a stream is refused before it starts
        (CHAT, {"model": MODEL, "messages": HI, "seed": 2**64}, 400, "invalid_value", "seed", "64-bit signed integer"),
        (CHAT, {"model": MODEL, "messages": HI, "seed": 2**64, "stream": True}, 400, "invalid_value", "seed", "64-bit signed integer"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "seed": -(2**63) - 1}, 400, "invalid_value", "seed", "64-bit signed integer"),
        # strict where OpenAI is strict
        (CHAT, {"model": MODEL, "messages": HI, "stream": "yes"}, 400, "invalid_type", "stream", "valid boolean"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "ignore_eos": 1}, 400, "invalid_type", "ignore_eos", "valid boolean"),
        (CHAT, {"model": MODEL, "messages": HI, "stop": [str(i) for i in range(10_000)]}, 400, "array_above_max_length", "stop", "maximum length 4"),
        (CHAT, {"model": MODEL, "messages": HI, "priority": 10**30}, 400, "integer_above_max_value", "priority", "less than or equal to 2147483647"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "priority": -(10**30)}, 400, "integer_below_min_value", "priority", "greater than or equal to -2147483648"),
    ],
)
def test_bad_requests_get_an_openai_error_and_schedule_nothing(server, engine, route, body, status, code, param, message):
    before = engine.stats()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(server.url + route, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["param"] == param
    assert message in err["message"]
    after = engine.stats()
    assert (after.num_steps, after.prefix_cache_queries, after.num_running, after.num_waiting) == (before.num_steps, before.prefix_cache_queries, 0, 0)
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_refused_before_it_is_parsed(server, engine, chunked):
    """30 MB of prompt (it used to be tokenized for a minute before its 400): a 413 at once."""
    before = engine.stats()
    body = json.dumps({"model": MODEL, "prompt": "word " * 6_000_000}).encode()
    content = (body[i : i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    resp = httpx.post(server.url + COMPLETIONS, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "request_too_large")
    assert str(MAX_BODY_BYTES) in err["message"]
    after = engine.stats()
    assert (after.num_steps, after.prefix_cache_queries) == (before.num_steps, before.prefix_cache_queries)
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_extremes_of_seed_and_priority_are_served(client):
    for seed, priority in ((2**63 - 1, 2**31 - 1), (-(2**63), -(2**31))):
        ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=seed, extra_body={"priority": priority})
        assert ok.choices[0].finish_reason == "length"


def test_the_sdk_surfaces_errors_and_accepts_ignored_openai_fields(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=HI)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=HI, top_p=0)
    ok = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, user="alice", metadata={"k": "v"}, store=False)
    assert ok.choices[0].message.role == "assistant"


def test_unknown_route_is_an_openai_error(server):
    resp = httpx.get(server.url + "/v1/engines")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


async def test_health_reports_a_stopped_engine(smollm, llm_gguf_path):
    eng = AsyncEngine(core=build_engine(make_config(str(llm_gguf_path), num_kv_blocks=16), smollm))
    with BackgroundServer(create_app(eng, MODEL)) as srv:
        async with httpx.AsyncClient(base_url=srv.url) as http:
            assert (await http.get("/health")).status_code == 200
            await asyncio.to_thread(eng.shutdown)
            health = await http.get("/health")
            chat = await http.post(CHAT, json={"messages": HI})
    for resp in (health, chat):
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"


def test_command_line_settings(llm_gguf_path):
    s = parse_settings(["--model", str(llm_gguf_path), "--port", "9001", "--max-num-seqs", "3", "--no-enable-prefix-caching"])
    assert (s.host, s.port, s.engine.max_num_seqs, s.engine.enable_prefix_caching) == ("127.0.0.1", 9001, 3, False)
    assert s.max_body_bytes == MAX_BODY_BYTES
    assert parse_settings(["--model", str(llm_gguf_path), "--max-body-bytes", "4096"]).max_body_bytes == 4096
    assert s.model_name == llm_gguf_path.stem
    assert parse_settings(["--model", str(llm_gguf_path), "--served-model-name", "m"]).model_name == "m"


def test_the_model_is_required_on_the_command_line(capsys):
    """The engine knows no default model (the assistant's embedded one is resolved by the assistant)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--port", "9001"])
    assert exit_info.value.code == 2 and "--model" in capsys.readouterr().err
