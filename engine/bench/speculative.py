"""``python -m engine.bench speculative --model PATH [--draft-model PATH] --documents FILE...
--questions FILE``: what speculative decoding (engine/speculative.py) buys on questions answered
from documents, with n-gram prompt lookup and, given ``--draft-model``, with a draft model
(engine/draft_model.py).

Each question is asked with the documents in front of it (the chat template's user message),
greedy, by engines on the same target weights: one without speculation (the baseline), one with
``speculative="ngram"`` (drafts from the prompt and from the answers kept since the batch size
began, ``--answer-cache-tokens``; with ``--prompt-lookup-too`` also one from the prompt alone) and
one with ``speculative="draft"``. Questions run alone (batch 1) and in
groups of each ``--batch`` size. Printed for each: decode tokens/s (output tokens after the first,
over the time from the group's first token to its last) of each and its ratio to the baseline, the
drafts' acceptance rate and the tokens a verifying step appends, whether the outputs are token for
token the same (greedy: they must be, but where the plain engine's top two tokens are a near-tie a
multi-row step may round the other way: each answer that parts is shown with plain's top-2 log-prob
gap there, and the bench exits 1 if one parts at a gap wider than ``NEAR_TIE``), the draft model's
step time beside a plain decode step's,
where each engine's steps went, the batch sizes at which each kind pays, and batch-1 decode
against the bandwidth ceiling of a one-token step (weights and KV bytes / copy bandwidth), which
speculation can pass: it appends several tokens for one read of the weights.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from dataclasses import asdict, replace
from pathlib import Path

from engine.bench.ceilings import copy_bandwidth, decode_step_bytes
from engine.bench.report import Row, device_name, format_table
from engine.config import ROW_COST_BY_DEVICE, EngineConfig
from engine.device_speculation import DeviceSpeculationStats
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.loaded_model import LoadedModel
from engine.metrics import StepTimes
from engine.sampling import SamplingParams
from engine.speculative import NgramProposer, SpecDecodeStats


def run_group(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int, float]:
    """Answer ``prompts`` together (greedy): their tokens, and the decode tokens and seconds (from
    the group's first token to its last)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    reqs = [core.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    first = min(r.metrics.first_token_time for r in reqs)
    last = max(r.metrics.last_token_time for r in reqs)
    return [tokens[r.request_id] for r in reqs], sum(len(t) - 1 for t in tokens.values()), last - first


NEAR_TIE = 0.05
"""A greedy answer may part from the plain engine's where plain's top two log-probs are this close:
a verifying step computes its rows with other kernels than a one-token step, and bf16 rounds them
differently (partings measured at 0.008, H200, 2026-12-07). A parting at a wider gap is a fault
(a KV block mapping fault parted at 0.116)."""


def parting_gaps(core: EngineCore, group: list[list[int]], want: list[list[int]], got: list[list[int]],
                 max_tokens: int) -> list[tuple[int, int, float | None]]:
    """For each answer in ``got`` that parts from the plain engine's (``want``, the group answered
    together by ``core``): its index in the group, the token where it parts, and plain's top-2
    log-prob gap there (None when plain's answer ended there), from the group answered again with
    log-probs, untimed."""
    parted = [(i, next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w))))
              for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if not parted:
        return []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    reqs = [core.add_request(p, params) for p in group]
    logprobs: dict[str, list[dict[int, float]]] = {r.request_id: [] for r in reqs}
    while core.has_unfinished_requests():
        for out in core.step():
            logprobs[out.request_id] += out.logprobs or []
    gaps = []
    for i, at in parted:
        lps = logprobs[reqs[i].request_id]
        top = sorted(lps[at].values(), reverse=True)[:2] if at < len(lps) else []
        gaps.append((i, at, top[0] - top[1] if len(top) == 2 else None))
    return gaps


def step_profile(times: StepTimes) -> str:
    """Where an engine's steps went: per execution path the steps, their mean host time (schedule
    to outputs) and, on CUDA, their mean device span; the device's idle time between steps (and,
    apart, after each step read back at once: the host's turnaround to the next launch); the
    host's phases a step (the first includes proposing drafts, and reading back the step in
    flight when drafts need its tokens)."""
    parts = []
    for mode, (seconds, steps, tokens) in sorted(times.by_mode.items()):
        device = times.device_span.get(mode)
        span = f", device {1e3 * device[0] / device[1]:.2f} ms" if device and device[1] else ""
        parts.append(f"{mode} {int(steps)} steps of {tokens / steps:.1f} tokens, host {1e3 * seconds / steps:.2f} ms{span}")
    idle = f"; device idle {1e3 * times.device_idle:.1f} ms" if times.device_span else ""
    if times.read_back_launches:
        n = times.read_back_launches
        device = f", device idle {1e3 * times.read_back_idle / n:.2f} ms" if times.device_span else ""
        idle += f"; {n} launches after a step read back at once: host {1e3 * times.read_back_turnaround / n:.2f} ms from read back to launch{device}"
    steps = max(times.steps, 1)
    phases = (f"; host a step: schedule (with drafting) {1e3 * times.schedule / steps:.2f} ms, prepare {1e3 * times.prepare / steps:.2f}, "
              f"launch {1e3 * times.forward / steps:.2f}, read back {1e3 * times.postprocess / steps:.2f}")
    return "; ".join(parts) + idle + phases


def main(argv: list[str]) -> int:
    """Run every question on each engine at each batch size and print the table."""
    p = argparse.ArgumentParser(prog="python -m engine.bench speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model path (a GGUF, e.g. the Qwen2.5-Coder-1.5B the assistant runs)")
    p.add_argument("--draft-model", help="also a draft model of the same tokenizer (e.g. the Qwen2.5-Coder-0.5B GGUF)")
    p.add_argument("--quantization", default="none", choices=("none", "int4", "fp8"))
    p.add_argument("--documents", type=Path, nargs="+", required=True, help="text put in front of every question")
    p.add_argument("--questions", type=Path, required=True, help="a text file, one question a line")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="group sizes (1: each question alone)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--ngram-sizes", type=int, nargs=2, default=list(EngineConfig.speculative_ngram_sizes), metavar=("MIN", "MAX"),
                   help="speculative_ngram_sizes: the n-gram lengths looked up (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=EngineConfig.speculative_max_batch,
                   help="speculative_max_batch: groups larger than this decode without drafts (0: the largest --batch, to "
                        "see where speculation stops paying)")
    p.add_argument("--row-cost", type=float, default=None,
                   help="speculative_row_cost: a draft row's cost in steps (default: the device's, "
                   f"{', '.join(f'{d} {c}' for d, c in ROW_COST_BY_DEVICE.items())})")
    p.add_argument("--draft-cost", type=float, default=EngineConfig.speculative_draft_cost,
                   help="speculative_draft_cost: a draft model's step as a share of the target's (default %(default)s)")
    p.add_argument("--answer-cache-tokens", type=int, default=EngineConfig.speculative_answer_cache_tokens,
                   help="n-gram drafts also from the last answers, this many tokens (0: prompt lookup only); "
                        "emptied before each batch size, so that no question meets its own earlier answer")
    p.add_argument("--device-too", action="store_true",
                   help="also an n-gram engine with speculative_device on (drafts, verification and the next step's inputs "
                        "decided on the device; greedy steps launched before the one before them is read back)")
    p.add_argument("--prompt-lookup-too", action="store_true",
                   help="also an n-gram engine without the answer cache (what the answers add, in the same run)")
    p.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                   help="launch each step before the last one is read back (auto: on with CUDA); n-gram drafts then "
                        "go ahead of the step in flight, on a guess of its token")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    max_batch = args.max_batch or max(args.batch)
    base = EngineConfig(model=str(args.model), quantization=args.quantization, max_model_len=4096,
                        max_num_seqs=max(args.batch), speculative_max_batch=max_batch, async_scheduling=args.async_scheduling)
    loaded = LoadedModel.load(base)
    if loaded.device.type == "cuda":  # engines share the GPU: a fixed KV pool each, not 0.9 of its memory for the first
        base = replace(base, kv_cache_memory_bytes=4 << 30)
    engines = {"plain": build_engine(base, loaded)}
    spec = replace(base, num_speculative_tokens=args.k, speculative_row_cost=args.row_cost, speculative_ngram_sizes=tuple(args.ngram_sizes))
    engines["ngram"] = build_engine(replace(spec, speculative="ngram", speculative_device="off",
                                             speculative_answer_cache_tokens=args.answer_cache_tokens), loaded)
    if args.device_too:
        engines["ngram_device"] = build_engine(replace(spec, speculative="ngram", speculative_device="on",
                                                       speculative_answer_cache_tokens=args.answer_cache_tokens), loaded)
    if args.prompt_lookup_too:
        engines["ngram_prompt"] = build_engine(replace(spec, speculative="ngram", speculative_device="off", speculative_answer_cache_tokens=0),
                                                   loaded)
    if args.draft_model:
        engines["draft"] = build_engine(replace(spec, speculative="draft", draft_model=str(args.draft_model),
                                                speculative_draft_cost=args.draft_cost), loaded)
    documents = "\n\n".join(path.read_text(encoding="utf-8") for path in args.documents)
    questions = [q.strip() for q in args.questions.read_text(encoding="utf-8").splitlines() if q.strip()]
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": f"{documents}\n\nQuestion: {q}"}]) for q in questions]
    bw = copy_bandwidth(loaded.device)
    print(f"# engine.bench speculative on {device_name(loaded.device)}, {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; "
          f"model {Path(args.model).name} ({args.quantization}), draft model {Path(args.draft_model).name if args.draft_model else '-'}, "
          f"k={args.k}, n-grams {args.ngram_sizes[0]}..{args.ngram_sizes[1]}, n-gram answer cache {args.answer_cache_tokens} tokens, row cost {spec.row_cost(loaded.device.type)}, draft cost {args.draft_cost}, drafts at batches up to {max_batch}, "
          f"{len(questions)} questions, "
          f"prompt of the first question {len(prompts[0])} tokens, copy bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    for core in engines.values():  # the documents' KV into each engine's prefix cache, and every code path once
        run_group(core, prompts[:1], 8)
    kinds = [k for k in engines if k != "plain"]
    names = {"ngram": "n-gram speculation", "ngram_device": "n-gram speculation on the device",
             "ngram_prompt": "n-gram speculation, prompt lookup only", "draft": f"draft model {Path(args.draft_model or '').name}"}
    rows, results, lines = [], {}, []
    faults = 0  # answers parting from plain's other than at a near-tie
    for batch in args.batch:
        spent = {k: [0, 0.0] for k in engines}
        same = dict.fromkeys(kinds, 0)
        for kind in kinds:
            engines[kind].spec_stats = SpecDecodeStats()
            engines[kind].device_stats = DeviceSpeculationStats()  # this batch size's, not the warm-up's
            proposer = engines[kind].proposer
            if isinstance(proposer, NgramProposer) and proposer.answers is not None:
                proposer.answers.clear()
        for core in engines.values():
            core.step_times = StepTimes()
        draft_times = engines["draft"].proposer.times if "draft" in engines else None
        draft_before = (draft_times.steps, draft_times.seconds) if draft_times else (0, 0.0)
        differing: dict[str, list] = {kind: [] for kind in kinds}  # (first question, the group, plain's answers, the kind's)
        for start in range(0, len(prompts), batch):
            group = prompts[start : start + batch]
            print(f"... batch {batch}: questions {start + 1}-{start + len(group)}", file=sys.stderr, flush=True)
            want, n, s = run_group(engines["plain"], group, args.max_tokens)
            spent["plain"][0] += n
            spent["plain"][1] += s
            for kind in kinds:
                got, n, s = run_group(engines[kind], group, args.max_tokens)
                spent[kind][0] += n
                spent[kind][1] += s
                same[kind] += sum(a == b for a, b in zip(got, want))
                if got != want:
                    differing[kind].append((start, group, want, got))
        plain_tps = spent["plain"][0] / spent["plain"][1]
        results[f"decode_bs{batch}_tok_s"] = plain_tps
        for kind in kinds:
            tps = spent[kind][0] / spent[kind][1]
            st = engines[kind].spec_stats
            rows.append(Row(f"decode, batch {batch}: {names[kind]} (k={args.k})", tps, "tok/s", "no speculation (baseline)", plain_tps))
            lines.append(f"  batch {batch}, {names[kind]}: {st.num_drafts} verifying steps, acceptance {st.acceptance_rate or 0:.1%} of "
                         f"{st.num_draft_tokens} drafts, {st.mean_accepted_length or 1:.2f} tokens a verifying step, "
                         f"accepted by position {st.accepted_per_pos}; {st.num_drafts_ahead} drafted ahead of the step in "
                         f"flight, their guess of its token right {st.num_guesses_right}; identical outputs {same[kind]}/{len(prompts)}")
            results[f"spec_{kind}_bs{batch}_speedup"] = tps / plain_tps
            results[f"spec_{kind}_bs{batch}_tok_s"] = tps
            results[f"spec_{kind}_bs{batch}_acceptance"] = st.acceptance_rate
            results[f"spec_{kind}_bs{batch}_drafted_ahead"] = st.num_drafts_ahead
            results[f"spec_{kind}_bs{batch}_guesses_right"] = st.num_guesses_right
            results[f"spec_{kind}_bs{batch}_identical"] = f"{same[kind]}/{len(prompts)}"
            ds = engines[kind].device_stats
            host_way = st.num_drafts - ds.verifications  # every verification is in spec_stats, the device's also in ds
            if ds.steps:  # where device speculation's read backs come from
                lines.append(f"  batch {batch}, {names[kind]}: {ds.steps} device steps ({ds.verifications} request verifications), "
                             f"{ds.entries} entries ({ds.entries_ahead} on the samples of a step in flight), leaves: "
                             f"{ds.leaves_for_yield} for its yield, {ds.leaves_other} other; {ds.drops} requests dropped as they finished "
                             f"(the others stayed); {host_way} request verifications the host's way")
                results[f"spec_{kind}_bs{batch}_device"] = asdict(ds) | {"host_verifications": host_way}
        for kind, core in engines.items():
            lines.append(f"  batch {batch}, {names.get(kind, 'no speculation')} steps: {step_profile(core.step_times)}")
            t = core.step_times
            if kind != "plain" and t.read_back_launches:  # what a step read back at once cost, per such launch
                results[f"spec_{kind}_bs{batch}_read_back_launches"] = t.read_back_launches
                results[f"spec_{kind}_bs{batch}_read_back_turnaround_ms"] = 1e3 * t.read_back_turnaround / t.read_back_launches
                if t.device_span:
                    results[f"spec_{kind}_bs{batch}_read_back_idle_ms"] = 1e3 * t.read_back_idle / t.read_back_launches
        for kind in kinds:  # after the step profiles: plain answers again, untimed
            partings = [(start + i + 1, at, gap) for start, group, want, got in differing[kind]
                        for i, at, gap in parting_gaps(engines["plain"], group, want, got, args.max_tokens)]
            faults += sum(gap is None or gap > NEAR_TIE for _, _, gap in partings)
            results[f"spec_{kind}_bs{batch}_partings"] = [{"question": q, "token": at, "plain_top2_gap": gap} for q, at, gap in partings]
            if partings:
                lines.append(f"  batch {batch}, {names[kind]} parts from plain: " + ", ".join(
                    f"question {q} at token {at} (plain's top-2 gap {'-' if gap is None else f'{gap:.4f}'}"
                    f"{', a near-tie' if gap is not None and gap <= NEAR_TIE else ''})" for q, at, gap in partings))
        if draft_times is not None and draft_times.steps > draft_before[0]:
            ms = 1e3 * (draft_times.seconds - draft_before[1]) / (draft_times.steps - draft_before[0])
            lines.append(f"  batch {batch}, draft model: {draft_times.steps - draft_before[0]} draft steps, {ms:.1f} ms each with the "
                         f"host's work (a plain decode token took {1e3 / plain_tps * batch:.1f} ms a step at this batch)")
            results[f"spec_draft_bs{batch}_draft_step_ms"] = ms
            st = engines["draft"].spec_stats
            if batch == 1 and st.num_drafts:  # a request's cycle: its draft steps, then one verifying step
                plain_ms = 1e3 / plain_tps
                steps = (draft_times.steps - draft_before[0]) / st.num_drafts
                drafts = st.num_draft_tokens / st.num_drafts
                verify = 1 + spec.row_cost(loaded.device.type) * drafts  # the verifying step, in plain steps
                bound = (st.mean_accepted_length or 1) / (steps * ms / plain_ms + verify)
                even = ((st.mean_accepted_length or 1) - verify) / steps  # the draft step's share of a plain one that breaks even
                lines.append(f"  batch 1, draft model's cycle: {steps:.2f} draft steps of {ms / plain_ms:.2f} plain steps each and a "
                             f"verifying step of ~{verify:.2f}, for {st.mean_accepted_length or 1:.2f} tokens: at most {bound:.2f}x with "
                             f"no host time between them; the drafts pay while a draft step costs under {even:.2f} of a plain step")
                results["spec_draft_bs1_cycle_bound"] = bound
                results["spec_draft_bs1_break_even_draft_step"] = even
        if batch == 1:
            ceiling = bw / decode_step_bytes(engines["plain"], len(prompts[0]) + args.max_tokens // 2)
            rows.append(Row("decode, batch 1, no speculation", plain_tps, "tok/s", "bandwidth ceiling of a 1-token step", ceiling))
            for kind in kinds:
                rows.append(Row(f"decode, batch 1, {names[kind]}", spent[kind][0] / spent[kind][1], "tok/s",
                                "bandwidth ceiling of a 1-token step", ceiling))
            results["decode_bs1_ceiling_tok_s"] = ceiling
    for kind in kinds:
        paying = [b for b in args.batch if results[f"spec_{kind}_bs{b}_speedup"] > 1.0]
        results[f"spec_{kind}_pays_at_batches"] = paying
        lines.append(f"  {names[kind]} pays (speed-up > 1) at batch {', '.join(map(str, paying)) or 'none of ' + str(args.batch)}")
    print(format_table(rows))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": sys.argv,
                                         "machine": platform.node(), "device": device_name(loaded.device),
                                         "row_cost": spec.row_cost(loaded.device.type), "results": results}, indent=2))
    return 1 if faults else 0  # greedy: an answer parting other than at a near-tie is a bug
