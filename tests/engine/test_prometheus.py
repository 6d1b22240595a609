"""/metrics: vLLM-named Prometheus series that move by exactly what known traffic did."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import AsyncEngine, SamplingParams, build_engine
from engine.llm import make_config
from engine.serving.prometheus import EngineMetrics, token_buckets
from engine.serving.server import BackgroundServer, create_app
from tests.engine.helpers import wait_idle

MODEL = "smollm2-metrics"


@pytest.fixture(scope="module")
def engine(smollm, llm_gguf_path):
    # Two seats, so a third, more urgent request has to preempt.
    eng = AsyncEngine(core=build_engine(make_config(str(llm_gguf_path), num_kv_blocks=256, max_num_seqs=2), smollm))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, MODEL)) as srv:
        yield srv


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def scrape(server) -> dict[str, float]:
    """Every sample of /metrics by name (+ labels other than model_name)."""
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return samples




async def test_counters_and_histograms_move_by_the_known_traffic(server, engine, aclient):
    await wait_idle(engine)
    before = scrape(server)
    prompt = list(range(2000, 2040))  # 40 tokens: the repeat finds 2 blocks (32 tokens) cached
    a = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    b = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    c = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                              max_tokens=30, temperature=0)  # ends with EOS well before 30 tokens
    await wait_idle(engine)  # the stats snapshot is taken after the last step
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    usages = [r.usage for r in (a, b, c)]
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert (a.usage.prompt_tokens, b.usage.prompt_tokens) == (40, 40)
    assert b.usage.prompt_tokens_details.cached_tokens == 32
    assert c.choices[0].finish_reason == "stop"

    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:request_success_total{finished_reason=length}") == 2
    assert delta("vllm:request_success_total{finished_reason=stop}") == 1
    assert delta("vllm:request_success_total{finished_reason=abort}") == 0
    assert delta("vllm:prefix_cache_queries_total") == prompt_tokens
    assert delta("vllm:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages) == 32
    assert delta("vllm:num_preemptions_total") == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"vllm:{hist}_count") == 3, hist
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == generated
    assert delta("vllm:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert delta("vllm:request_time_per_output_token_seconds_count") == sum(u.completion_tokens > 1 for u in usages)
    assert 0 < delta("vllm:time_to_first_token_seconds_sum") < delta("vllm:e2e_request_latency_seconds_sum")
    assert delta("vllm:request_decode_time_seconds_sum") <= delta("vllm:e2e_request_latency_seconds_sum")
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0

    # Where the engine's time went, by execution path: every token computed is in exactly one step
    # (the uncached prompt tokens, then one a decode step for each token but a request's last).
    def by_mode(name: str) -> dict[str, float]:
        prefix = f"engine_{name}_total{{mode="
        return {k[len(prefix):-1]: delta(k) for k in after if k.startswith(prefix) and delta(k)}

    steps, tokens, host = by_mode("steps"), by_mode("step_tokens"), by_mode("step_seconds")
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert sum(tokens.values()) == prompt_tokens - cached + sum(u.completion_tokens - 1 for u in usages)
    assert set(steps) == set(tokens) == set(host) and set(steps) <= {"native", "eager"}  # a CPU engine's paths
    assert sum(steps.values()) >= max(u.completion_tokens for u in usages) and all(h > 0 for h in host.values())
    assert not any(k.startswith("engine_step_device_seconds") for k in after)  # CUDA events only
    assert after["engine_device_idle_seconds_total"] == 0
    # a CPU engine reads every step back at once: each launch with requests still running follows one
    read_backs = delta("engine_read_back_launches_total")
    assert 0 < read_backs < sum(steps.values()) and delta("engine_read_back_turnaround_seconds_total") > 0
    assert after["engine_device_idle_after_read_back_seconds_total"] == 0  # CUDA events only


async def test_gauges_show_a_running_request_and_its_kv(server, engine, aclient):
    await wait_idle(engine)
    stream = await aclient.completions.create(model=MODEL, prompt=list(range(100, 150)), max_tokens=1000, stream=True,
                                              extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    during = await asyncio.to_thread(scrape, server)
    await stream.close()
    await wait_idle(engine)
    after = scrape(server)
    assert during["vllm:num_requests_running"] == 1 and during["vllm:num_requests_waiting"] == 0
    assert 0 < during["vllm:kv_cache_usage_perc"] < 1
    total = during["vllm:kv_cache_blocks_total"]
    assert during["vllm:kv_cache_blocks_in_use"] == round(during["vllm:kv_cache_usage_perc"] * total) >= 50 / 16  # 50 prompt tokens
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:kv_cache_blocks_in_use"] == 0 and after["vllm:kv_cache_blocks_total"] == total


async def test_priority_preempts_and_aborts_are_counted(server, engine, aclient):
    await wait_idle(engine)
    before = scrape(server)
    preemptions = engine.stats().num_preemptions

    async def background(i: int):
        stream = await aclient.completions.create(model=MODEL, prompt=list(range(200 + 50 * i, 230 + 50 * i)), max_tokens=1000,
                                                  stream=True, extra_body={"ignore_eos": True, "priority": 10})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                return stream
        raise AssertionError("no token")

    streams = await asyncio.gather(background(0), background(1))  # both seats taken
    urgent = await aclient.completions.create(model=MODEL, prompt=list(range(900, 910)), max_tokens=3,
                                              extra_body={"ignore_eos": True, "priority": 0})
    assert urgent.choices[0].finish_reason == "length"
    for s in streams:
        await s.close()
    await wait_idle(engine)
    after = scrape(server)
    assert engine.stats().num_preemptions > preemptions
    assert after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"] == engine.stats().num_preemptions - preemptions
    assert after["vllm:request_success_total{finished_reason=abort}"] - before["vllm:request_success_total{finished_reason=abort}"] == 2
    assert after["vllm:request_success_total{finished_reason=length}"] - before["vllm:request_success_total{finished_reason=length}"] == 1


def test_each_app_has_its_own_registry(engine):
    """Two metric sets on one engine coexist (a process-global registry would reject the second)."""
    one, two = EngineMetrics(engine, "one", 4096), EngineMetrics(engine, "two", 4096)
    assert one.registry is not two.registry
    assert b'model_name="one"' in one.render()[0] and b'model_name="two"' not in one.render()[0]


async def test_reset_forgets_a_warm_up_and_counts_what_follows(engine):
    """A server's own warm-up (the assistant's documents prefix) is not reported as traffic."""
    metrics = EngineMetrics(engine, "warm", 4096)

    def sample(name: str, **labels: str) -> float:
        families = text_string_to_metric_families(metrics.render()[0].decode())
        return next(s.value for f in families for s in f.samples if s.name == name and labels.items() <= s.labels.items())

    async def request() -> None:
        async for _ in engine.generate(list(range(3000, 3040)), SamplingParams(max_tokens=2, ignore_eos=True)):
            pass

    await request()
    assert sample("vllm:e2e_request_latency_seconds_count") == 1
    await asyncio.to_thread(metrics.reset)
    assert sample("vllm:e2e_request_latency_seconds_count") == 0
    for name in ("vllm:generation_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total"):
        assert sample(name) == 0, name
    assert sample("vllm:request_success_total", finished_reason="length") == 0
    await request()  # the prefix the warm-up computed is still cached
    await wait_idle(engine)  # the engine's counters are read from its snapshot after the step
    assert sample("vllm:e2e_request_latency_seconds_count") == 1
    assert sample("vllm:request_success_total", finished_reason="length") == 1
    assert sample("vllm:generation_tokens_total") == 2 and sample("vllm:prefix_cache_hits_total") == 32


def test_token_buckets_are_vllm_1_2_5_up_to_the_context():
    assert token_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert token_buckets(8192)[-1] == 5000
