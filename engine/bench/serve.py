"""Load generator for any OpenAI-compatible server: ``python -m engine.bench serve --base-url URL``.

Requests arrive as a Poisson process (``--request-rate R``; ``inf`` sends them all at once) whose
gaps are gamma-distributed for burstiness (``--burstiness``: 1 is Poisson, below 1 burstier,
above 1 steadier; as vLLM's ``bench serve``), optionally capped at ``--max-concurrency N``.
Every request streams over SSE (httpx), so TTFT, inter-token latency (ITL), time per output
token after the first (TPOT) and end-to-end latency (E2E) are measured at the client.

The reference figure, measured first in the same run, is the latency of requests sent one at a
time (concurrency 1) on the same workload: the loaded figures are shown as multiples of it.
Goodput is the rate of requests that met every SLO given with ``--slo ttft=200ms,tpot=30ms,e2e=2s``.

``--request-rate 1,2,4,8,inf`` sweeps: the same number of fresh prompts at each rate in turn, one
table row per rate (latency percentiles, throughput, goodput) and, with ``--plot``, latency and
goodput against the offered rate, which is where a server's capacity at an SLO shows.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import platform
import random
import re
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

METRICS = ("ttft", "tpot", "itl", "e2e")
SLO_METRICS = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)
# Common English words: random prompts of them tokenize to about one token per word.
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "not but first one their its new after who they two her she been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made team american three while film under "
    "war part well year south north also both between river until including could through against game "
    "company house since high series early several city music called water light paper number people"
).split()


@dataclass
class BenchConfig:
    """Everything one run needs, from the command line."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    num_prompts: int = 40
    request_rates: tuple[float, ...] = (math.inf,)  # one load per rate, in turn
    burstiness: float = 1.0
    max_concurrency: int | None = None
    input_len: tuple[int, int] = (64, 64)
    output_len: tuple[int, int] = (32, 32)
    dataset: Path | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    slo: dict[str, float] = field(default_factory=dict)
    baseline_requests: int = 3
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    json_path: Path | None = None
    plot_path: Path | None = None
    progress: bool = True

    @property
    def chat(self) -> bool:
        return "chat" in self.endpoint


@dataclass
class Prompt:
    text: str
    max_tokens: int


@dataclass
class RequestResult:
    """What the client saw of one request (seconds; ``ttft`` None if no token arrived)."""

    success: bool
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's definition)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def value(self, metric: str) -> float | None:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}[metric]

    def meets(self, slo: dict[str, float]) -> bool:
        """True if successful and within every SLO (a metric it has no value for is not held against it)."""
        if not self.success:
            return False
        return all((v := self.value(m)) is None or v <= limit for m, limit in slo.items())


# ---- command line --------------------------------------------------------------------------------
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_slo(text: str) -> dict[str, float]:
    """``ttft=200ms,tpot=30ms,e2e=2s`` -> seconds per metric (a bare number is milliseconds)."""
    slo = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\w+)\s*[=:]\s*([0-9.]+)\s*(us|ms|s)?", part)
        if m is None:
            raise ValueError(f"bad SLO {part!r}: expected NAME=VALUE[us|ms|s], e.g. ttft=200ms")
        name = "e2e" if m[1] == "e2el" else m[1]
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {m[1]!r}: choose from {', '.join(SLO_METRICS)}")
        slo[name] = float(m[2]) * _UNITS[m[3] or "ms"]
    return slo


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad request rate {text!r}: expected R or R1,R2,... (req/s, or inf)") from None
    if not rates:
        raise argparse.ArgumentTypeError("--request-rate needs at least one rate")
    return rates


def _length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"bad length range {text!r}: expected N or MIN:MAX with 1 <= MIN <= MAX")
    return lo_i, hi_i


def parse_args(argv: Sequence[str]) -> BenchConfig:
    p = argparse.ArgumentParser(prog="python -m engine.bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root (without /v1)")
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--request-rate", type=_rates, default=(math.inf,),
                   help="requests/s (Poisson); inf: all at once; a comma list (1,2,4,inf) sweeps the rates in turn")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, help="at most N requests in flight")
    p.add_argument("--input-len", type=_length_range, default=(64, 64), help="words per random prompt: N or MIN:MAX")
    p.add_argument("--output-len", type=_length_range, default=(32, 32), help="max_tokens: N or MIN:MAX")
    p.add_argument("--dataset", type=Path, help="prompts from a file: .jsonl of {prompt, max_tokens?}, else one per line")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM's extension) so outputs have their full length")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo", type=parse_slo, default={}, help="e.g. ttft=200ms,tpot=30ms,e2e=2s: goodput counts requests meeting all")
    p.add_argument("--baseline-requests", type=int, default=3, help="requests sent one at a time first, as the reference (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", help="sent as a Bearer token")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write a PNG of the latency distributions here")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.num_prompts < 1 or (a.max_concurrency is not None and a.max_concurrency < 1) or min(a.request_rate) <= 0 or a.burstiness <= 0:
        p.error("--num-prompts and --max-concurrency must be >= 1, --request-rate and --burstiness > 0")
    return BenchConfig(
        base_url=a.base_url.rstrip("/"), endpoint=a.endpoint, model=a.model, num_prompts=a.num_prompts,
        request_rates=a.request_rate, burstiness=a.burstiness, max_concurrency=a.max_concurrency,
        input_len=a.input_len, output_len=a.output_len, dataset=a.dataset, ignore_eos=a.ignore_eos,
        temperature=a.temperature, slo=a.slo, baseline_requests=a.baseline_requests, seed=a.seed,
        api_key=a.api_key, timeout_s=a.timeout, json_path=a.json, plot_path=a.plot, progress=not a.no_progress,
    )


# ---- workload ------------------------------------------------------------------------------------
def make_prompts(cfg: BenchConfig, n: int, rng: random.Random) -> list[Prompt]:
    """``n`` prompts: random words of the configured lengths, or cycled from ``--dataset``."""
    if cfg.dataset is None:
        return [Prompt(" ".join(rng.choices(WORDS, k=rng.randint(*cfg.input_len))), rng.randint(*cfg.output_len)) for _ in range(n)]
    lines = [line for line in cfg.dataset.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{cfg.dataset} holds no prompts")
    prompts = []
    for i in range(n):
        line = lines[i % len(lines)]
        if cfg.dataset.suffix == ".jsonl":
            record = json.loads(line)
            prompts.append(Prompt(record["prompt"], int(record.get("max_tokens") or rng.randint(*cfg.output_len))))
        else:
            prompts.append(Prompt(line, rng.randint(*cfg.output_len)))
    return prompts


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds before each request: gamma(shape=burstiness, mean=1/rate); all 0 at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


# ---- one request ---------------------------------------------------------------------------------
async def send_request(client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: Prompt) -> RequestResult:
    """Stream one request and time every content chunk."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": prompt.max_tokens, "temperature": cfg.temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    result = RequestResult(success=False, start=time.perf_counter())
    last = result.start
    chunks = 0
    try:
        async with client.stream("POST", cfg.endpoint, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return result
            async for data in _sse_data(resp):
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = json.dumps(event["error"])[:300]
                    return result
                if event.get("usage"):
                    result.prompt_tokens = event["usage"].get("prompt_tokens")
                    result.output_tokens = event["usage"].get("completion_tokens") or 0
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if cfg.chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - result.start
    result.output_tokens = result.output_tokens or chunks  # servers without streamed usage
    result.success = result.ttft is not None
    if not result.success:
        result.error = "no tokens were streamed"
    return result


async def _sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


# ---- a run ---------------------------------------------------------------------------------------
async def run_load(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompts: list[Prompt], gaps: list[float], bar: tqdm | None
) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` after ``gaps``, at most ``max_concurrency`` at once; (results, seconds)."""
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async def one(prompt: Prompt) -> RequestResult:
        if limit is None:
            result = await send_request(client, cfg, model, prompt)
        else:
            async with limit:
                result = await send_request(client, cfg, model, prompt)
        if bar is not None:
            bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for prompt, gap in zip(prompts, gaps):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(prompt)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict[str, Any]:
    """Throughputs, goodput and mean/percentiles (ms) of TTFT, TPOT, ITL and E2E."""
    ok = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    stats = {}
    for name, xs in values.items():
        arr = np.asarray(xs, dtype=float) * 1e3
        stats[f"{name}_ms"] = {"mean": float(arr.mean()) if arr.size else None,
                               **{f"p{q}": float(np.percentile(arr, q)) if arr.size else None for q in PERCENTILES}}
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    good = sum(1 for r in results if r.meets(slo))
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "goodput": good / duration if slo else None, "good_requests": good if slo else None,
        **stats,
    }


async def _bench(cfg: BenchConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=cfg.timeout_s, limits=limits) as client:
        model = cfg.model
        if model is None:
            resp = await client.get("/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        # Separate prompts for warm-up and baseline, so the loaded run gets no prefix-cache hits from them.
        warmup, *baseline_prompts = make_prompts(cfg, 1 + cfg.baseline_requests, rng)
        await send_request(client, cfg, model, warmup)
        baseline = None
        if baseline_prompts:
            results, seconds = await run_load(client, _serial(cfg), model, baseline_prompts, [0.0] * len(baseline_prompts), None)
            baseline = summarize(results, seconds, cfg.slo)
        sweep = []
        for rate in cfg.request_rates:  # fresh prompts at each rate: no prefix-cache hits from the last one
            prompts = make_prompts(cfg, cfg.num_prompts, rng)
            gaps = arrival_gaps(cfg.num_prompts, rate, cfg.burstiness, rng)
            desc = f"rate {_rate(rate)}"
            with tqdm(total=len(prompts), desc=desc, unit="req", disable=not cfg.progress, file=sys.stderr) as bar:
                results, seconds = await run_load(client, cfg, model, prompts, gaps, bar)
            sweep.append({"request_rate": rate, "load": summarize(results, seconds, cfg.slo), "results": results})
    return {"model": model, "baseline": baseline, "sweep": sweep}


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g} req/s"


def _serial(cfg: BenchConfig) -> BenchConfig:
    return BenchConfig(**{**asdict(cfg), "max_concurrency": 1})


# ---- report --------------------------------------------------------------------------------------
def format_report(cfg: BenchConfig, run: dict[str, Any]) -> str:
    """One rate: its latency table; a sweep: each rate's table, then one row per rate."""
    tables = [format_load(cfg, run["model"], step["request_rate"], step["load"], run["baseline"]) for step in run["sweep"]]
    if len(run["sweep"]) > 1:
        tables.append(format_sweep(cfg, run))
    return "\n\n".join(tables)


def format_sweep(cfg: BenchConfig, run: dict[str, Any]) -> str:
    """Latency percentiles, throughput and goodput against the offered request rate."""
    lines = [
        "| offered rate | completed | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p99 | output tok/s | goodput (req/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for step in run["sweep"]:
        load = step["load"]
        goodput = "" if load["goodput"] is None else f"{load['goodput']:.3f} ({load['good_requests']}/{load['completed'] + load['failed']})"
        lines.append(
            f"| {_rate(step['request_rate'])} | {load['completed']} | {_f(load['ttft_ms']['p50'])} | {_f(load['ttft_ms']['p99'])} | "
            f"{_f(load['tpot_ms']['p50'])} | {_f(load['tpot_ms']['p99'])} | {_f(load['itl_ms']['p99'])} | "
            f"{load['output_throughput']:.1f} | {goodput} |"
        )  # fmt: skip
    return "\n".join(lines)


def format_load(cfg: BenchConfig, model: str, request_rate: float, load: dict[str, Any], base: dict[str, Any] | None) -> str:
    """A markdown table of the loaded latencies next to the concurrency-1 reference, then throughputs."""
    rate = _rate(request_rate)
    lines = [
        f"model `{model}` at {cfg.base_url}{cfg.endpoint}: {cfg.num_prompts} requests, rate {rate}, "
        f"burstiness {cfg.burstiness:g}, max concurrency {cfg.max_concurrency or 'unlimited'}",
        "",
        "| latency (ms) | mean | p50 | p90 | p99 | concurrency-1 mean | loaded / conc-1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in METRICS:
        s = load[f"{name}_ms"]
        ref = base[f"{name}_ms"]["mean"] if base else None
        ratio = f"{s['mean'] / ref:.2f}x" if ref and s["mean"] is not None else ""
        lines.append(f"| {name.upper()} | {_f(s['mean'])} | {_f(s['p50'])} | {_f(s['p90'])} | {_f(s['p99'])} | {_f(ref)} | {ratio} |")
    lines += [
        "",
        f"- completed {load['completed']}, failed {load['failed']}, in {load['duration_s']:.2f} s",
        f"- request throughput {load['request_throughput']:.3f} req/s; output throughput {load['output_throughput']:.2f} tok/s"
        + (f" (concurrency 1: {base['output_throughput']:.2f} tok/s)" if base else "")
        + f"; total token throughput {load['total_token_throughput']:.2f} tok/s",
    ]
    if cfg.slo:
        slo = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in cfg.slo.items())
        lines.append(f"- goodput {load['goodput']:.3f} req/s ({load['good_requests']}/{cfg.num_prompts} requests met {slo})")
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "" if x is None else f"{x:,.1f}"


def write_plot(path: Path, cfg: BenchConfig, run: dict[str, Any]) -> None:
    """One rate: CDFs of its latencies; a sweep: latencies and goodput against the offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    if len(run["sweep"]) > 1:
        _plot_sweep(path, cfg, run)
    else:
        _plot_cdfs(path, cfg, run, run["sweep"][0])


def _plot_sweep(path: Path, cfg: BenchConfig, run: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    steps = run["sweep"]
    x = np.arange(len(steps))  # evenly spaced: an infinite rate has no place on a numeric axis
    labels = [_rate(s["request_rate"]).removesuffix(" req/s") for s in steps]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, name in zip(axes.flat[:3], ("ttft", "tpot", "itl")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [s["load"][f"{name}_ms"][q] or np.nan for s in steps], style, label=q)
        if name in cfg.slo:
            ax.axhline(cfg.slo[name] * 1e3, color="red", linestyle=":", label="SLO")
        ax.set_title(f"{name.upper()} (ms)")
    ax = axes.flat[3]
    ax.plot(x, [s["load"]["request_throughput"] for s in steps], "o-", label="completed req/s")
    if cfg.slo:
        ax.plot(x, [s["load"]["goodput"] for s in steps], "s-", label="goodput (met every SLO)")
    ax.set_title("throughput (req/s)")
    for ax in axes.flat:
        ax.set_xticks(x, labels)
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    slo = ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in cfg.slo.items()) or "no SLO"
    fig.suptitle(f"{run['model']}: {cfg.num_prompts} requests per rate, {slo}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_cdfs(path: Path, cfg: BenchConfig, run: dict[str, Any], step: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    ok = [r for r in step["results"] if r.success]
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None], "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [g for r in ok for g in r.itl], "e2e": [r.e2e for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, METRICS):
        xs = np.sort(np.asarray(series[name], dtype=float) * 1e3)
        if xs.size:
            ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label="under load")
        base = run["baseline"]
        if base and base[f"{name}_ms"]["mean"] is not None:
            ax.axvline(base[f"{name}_ms"]["mean"], color="gray", linestyle=":", label="concurrency-1 mean")
        if name in cfg.slo:
            ax.axvline(cfg.slo[name] * 1e3, color="red", linestyle="--", label="SLO")
        ax.set_title(f"{name.upper()} (n={xs.size})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of token gaps")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{run['model']}: {cfg.num_prompts} requests, rate {_rate(step['request_rate'])}, max concurrency {cfg.max_concurrency or 'unlimited'}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)
    try:
        run = asyncio.run(_bench(cfg))
    except httpx.HTTPError as e:
        print(f"error: cannot reach {cfg.base_url}: {e}", file=sys.stderr)
        return 1
    print(format_report(cfg, run))
    if cfg.json_path:
        record = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m engine.bench serve " + " ".join(argv),
            "versions": {"python": platform.python_version(), "httpx": httpx.__version__},
            "config": {k: _jsonable(v) for k, v in asdict(cfg).items() if k != "api_key"},
            "model": run["model"], "baseline_concurrency_1": run["baseline"],
            "sweep": [{"request_rate": _jsonable(step["request_rate"]), "load": step["load"],
                       "requests": [asdict(r) | {"tpot": r.tpot} for r in step["results"]]} for step in run["sweep"]],
        }
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(record, indent=2) + "\n")
    if cfg.plot_path:
        write_plot(cfg.plot_path, cfg, run)
    return 0 if all(step["load"]["failed"] == 0 for step in run["sweep"]) else 1


def _jsonable(x: Any) -> Any:
    """Paths as text and an infinite rate as "inf" (strict JSON has no Infinity)."""
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return x
