"""Prometheus metrics of one engine, with vLLM's names and meanings.

Names carry vLLM's ``vllm:`` prefix on purpose: the server is a drop-in for vLLM's OpenAI
server, so the Grafana dashboards, alerts and autoscalers written against vLLM work unchanged.
Only metrics whose meaning matches vLLM's use its names (see docs/serving.md).

Two sources, no global state (each :class:`EngineMetrics` has its own ``CollectorRegistry``):
- request histograms and finish counters are observed, on the engine thread, from each finished
  request's :class:`~engine.metrics.RequestMetrics` (every request, HTTP or not);
- gauges and engine-wide counters are read from :meth:`AsyncEngine.stats` at scrape time.

Where the engine's time goes has no vLLM equivalent, so it has names of its own (``engine_``,
labelled by ``mode``, the step's execution path: graph, mixed, piecewise, native, eager): steps,
their host seconds (schedule to outputs; with async scheduling this includes waiting for the step
before), their tokens, and on CUDA their device seconds (CUDA events) and the device's idle seconds
between chained steps; apart, the steps launched after a step read back at once (a verifying
step), the host's turnaround to them and (CUDA) the device's idle time before them. Two scrapes
give a phase's engine-busy and GPU-busy shares.

A server that warms its engine up with requests of its own calls :meth:`EngineMetrics.reset`
afterwards, so a fresh server reports no request (the engine's own start-up warm-up is never seen).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from engine.async_engine import AsyncEngine
from engine.metrics import EngineStats
from engine.outputs import RequestOutput

PREFIX = "vllm:"
OWN_PREFIX = "engine_"  # metrics with no vLLM counterpart
LABELS = ("model_name",)

# vLLM's buckets, so histogram_quantile() over our series compares with vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's ``build_1_2_5_buckets``)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(float(m * scale))
        scale *= 10


class EngineMetrics:
    """The ``/metrics`` of one engine; subscribes to its finished requests on construction."""

    # this model's series, bound by _start()
    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    prompt_len: Histogram
    output_len: Histogram
    prompt_tokens: Counter

    def __init__(self, engine: AsyncEngine, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self.engine = engine
        self.model_name = model_name
        self._families: dict[str, MetricWrapperBase] = {}  # attribute -> its family (labelled by model_name)

        def hist(attr: str, name: str, doc: str, buckets) -> None:
            self._families[attr] = Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry)

        hist("ttft", "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        hist("itl", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_GAP_BUCKETS)
        hist("tpot", "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", TOKEN_GAP_BUCKETS)
        hist("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_TIME_BUCKETS)
        hist("queue", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_TIME_BUCKETS)
        hist("prefill", "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQUEST_TIME_BUCKETS)
        hist("decode", "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_TIME_BUCKETS)
        hist("prompt_len", "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets(max_model_len))
        hist("output_len", "request_generation_tokens", "Number of generation tokens processed.", token_buckets(max_model_len))
        self._families["prompt_tokens"] = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=self.registry)
        self.success = Counter(PREFIX + "request_success", "Count of successfully processed requests.", (*LABELS, "finished_reason"), registry=self.registry)
        self._start()
        self.registry.register(_EngineStatsCollector(engine, model_name))
        engine.add_finish_listener(self.observe)

    def _start(self) -> None:
        """Bind each series of this model (``self.ttft``, ...) and export the finish reasons at 0, as vLLM does."""
        for attr, family in self._families.items():
            setattr(self, attr, family.labels(self.model_name))
        for reason in ("stop", "length", "abort"):
            self.success.labels(self.model_name, reason)

    def reset(self) -> None:
        """Forget every request so far: the engine's counters and every series back to zero.
        Only while no request is in flight (after a warm-up of the server's own, before serving)."""
        self.engine.reset_counters()
        for family in (*self._families.values(), self.success):
            family.clear()
        self._start()

    def observe(self, output: RequestOutput) -> None:
        """Record one finished request (called on the engine thread)."""
        self.success.labels(self.model_name, output.finish_reason or "abort").inc()
        m = output.metrics
        if m is None:
            return
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e), (self.queue, m.queue_time),
                            (self.prefill, m.prefill_time), (self.decode, m.decode_time)):
            if value is not None:
                hist.observe(value)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.first_token_time is not None:  # as vLLM: a prompt counts once its prefill is done
            self.prompt_tokens.inc(m.num_prompt_tokens)
            self.prompt_len.observe(m.num_prompt_tokens)
        self.output_len.observe(m.num_generated_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineStatsCollector(Collector):
    """Gauges and cumulative counters read from the engine's latest stats snapshot at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        gauges = (
            ("num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
            ("kv_cache_blocks_in_use", "KV-cache blocks held by requests (0 when idle: a leak shows here).",
             s.kv_blocks_total - s.kv_blocks_free),
            ("kv_cache_blocks_total", "KV-cache blocks the requests can use.", s.kv_blocks_total),
        )
        counters = (
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
            ("num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions),
            ("generation_tokens", "Number of generation tokens processed.", s.generation_tokens),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            g.add_metric([self.model_name], value)
            yield g
        for name, doc, value in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            c.add_metric([self.model_name], value)
            yield c
        yield from self._steps(s)
        yield from self._spec_decode(s)

    def _spec_decode(self, s: EngineStats) -> Iterator[Metric]:
        """Speculative decoding's counters, as vLLM names them (zero when it is off)."""
        for name, doc, value in (
            ("spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_drafts),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.spec_accepted_tokens),
        ):
            c = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            c.add_metric([self.model_name], value)
            yield c
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                      labels=(*LABELS, "position"))  # fmt: skip
        for pos, value in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], value)
        yield per_pos

    def _steps(self, s: EngineStats) -> Iterator[Metric]:
        """The step counters by execution path (see the module docstring)."""
        labels = (*LABELS, "mode")
        steps = CounterMetricFamily(OWN_PREFIX + "steps", "Engine steps, by execution path.", labels=labels)
        host = CounterMetricFamily(OWN_PREFIX + "step_seconds", "Host seconds of engine steps, schedule to outputs.", labels=labels)
        tokens = CounterMetricFamily(OWN_PREFIX + "step_tokens", "Tokens computed by engine steps.", labels=labels)
        device = CounterMetricFamily(OWN_PREFIX + "step_device_seconds", "Device seconds of engine steps (CUDA events).", labels=labels)
        for mode, (seconds, n, t) in s.step_host.items():
            steps.add_metric([self.model_name, mode], n)
            host.add_metric([self.model_name, mode], seconds)
            tokens.add_metric([self.model_name, mode], t)
        for mode, (seconds, _) in s.step_device.items():
            device.add_metric([self.model_name, mode], seconds)
        idle = CounterMetricFamily(OWN_PREFIX + "device_idle_seconds", "Device idle seconds between chained engine steps: "
                                   "host time async scheduling failed to hide.", labels=LABELS)  # fmt: skip
        idle.add_metric([self.model_name], s.device_idle_s)
        read_backs = CounterMetricFamily(OWN_PREFIX + "read_back_launches", "Engine steps launched after the step before them "
                                         "was read back at once (a verifying step; every step without async scheduling).",
                                         labels=LABELS)  # fmt: skip
        read_backs.add_metric([self.model_name], s.read_back_launches)
        turnaround = CounterMetricFamily(OWN_PREFIX + "read_back_turnaround_seconds", "Host seconds from each of those read "
                                         "backs to the next launch.", labels=LABELS)  # fmt: skip
        turnaround.add_metric([self.model_name], s.read_back_turnaround_s)
        idle_after = CounterMetricFamily(OWN_PREFIX + "device_idle_after_read_back_seconds", "Device idle seconds after those "
                                         "read backs, until the next step ran (CUDA events).", labels=LABELS)  # fmt: skip
        idle_after.add_metric([self.model_name], s.read_back_idle_s)
        yield from (steps, host, tokens, device, idle, read_backs, turnaround, idle_after)
