"""``python -m engine.bench speculative``: the plain, n-gram and draft-model engines on questions
about a document, in a process of its own, as the docs run it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_the_speculative_bench_prints_speedup_acceptance_and_identical_outputs(llm_gguf_path, tmp_path):
    questions = tmp_path / "q.txt"
    questions.write_text("How many days of annual leave do I get per year?\nHow do I apply for annual leave?\n")
    out = tmp_path / "spec.json"
    r = subprocess.run([sys.executable, "-m", "engine.bench", "speculative", "--model", str(llm_gguf_path), "--quantization", "int4",
                        "--draft-model", str(llm_gguf_path), "--documents",
                        str(REPO / "assistant/handbook/en/01-annual-leave.md"), "--questions", str(questions), "--batch", "1", "2",
                        "--max-tokens", "16", "--row-cost", "0.05", "--draft-cost", "0.05", "--prompt-lookup-too", "--device-too", "--async-scheduling", "on", "--ngram-sizes", "1", "6", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "decode, batch 1: n-gram speculation (k=4)" in r.stdout and "no speculation (baseline)" in r.stdout
    assert "k=4, n-grams 1..6, n-gram answer cache 32768 tokens" in r.stdout  # the cache: the engine's default, beside prompt lookup alone:
    assert "decode, batch 1: n-gram speculation, prompt lookup only (k=4)" in r.stdout
    assert "decode, batch 1: n-gram speculation on the device (k=4)" in r.stdout
    assert "bandwidth ceiling of a 1-token step" in r.stdout and "identical outputs 2/2" in r.stdout
    # async scheduling: n-gram drafts go ahead of the step in flight (the draft model's step is read back first)
    assert re.search(r"batch 1, n-gram speculation: .* [1-9]\d* drafted ahead of the step in flight, their guess of its token right \d+;", r.stdout)
    assert "batch 1, draft model" in r.stdout and re.search(r"batch 1, draft model [^\n]* 0 drafted ahead", r.stdout)
    for name in ("no speculation", "n-gram speculation"):  # where each engine's steps went, by execution path
        assert re.search(rf"batch 2, {name} steps: \w+ \d+ steps of [\d.]+ tokens, host [\d.]+ ms.*; host a step: schedule", r.stdout)
    assert re.search(r"n-gram speculation pays \(speed-up > 1\) at batch (none of \[1, 2\]|1|2|1, 2)\n", r.stdout)
    report = json.loads(out.read_text())
    assert report["row_cost"] == 0.05 and "row cost 0.05," in r.stdout  # the one the engines priced drafts at
    results = report["results"]
    for kind in ("ngram", "draft"):
        assert results[f"spec_{kind}_pays_at_batches"] == [b for b in (1, 2) if results[f"spec_{kind}_bs{b}_speedup"] > 1]
    assert "decode, batch 1: draft model" in r.stdout and "draft steps" in r.stdout
    # the draft model's cycle, priced from this run's steps: what it could give at most, and the draft step that breaks even
    cycle = re.search(r"batch 1, draft model's cycle: ([\d.]+) draft steps of ([\d.]+) plain steps each and a verifying step of "
                      r"~([\d.]+), for ([\d.]+) tokens: at most ([\d.]+)x with no host time between them; the drafts pay while a "
                      r"draft step costs under (-?[\d.]+) of a plain step", r.stdout)
    assert cycle, r.stdout[-3000:]
    steps, share, verify, tokens, bound, even = map(float, cycle.groups())
    assert steps >= 1 and share > 0 and 1 <= verify <= 1 + 0.05 * 4 and 1 <= tokens <= 5
    assert results["spec_draft_bs1_cycle_bound"] == pytest.approx(tokens / (steps * share + verify), rel=0.02)
    assert results["spec_draft_bs1_break_even_draft_step"] == pytest.approx((tokens - verify) / steps, abs=0.01)
    for batch in (1, 2):
        for kind in ("ngram", "ngram_prompt", "ngram_device", "draft"):
            assert results[f"spec_{kind}_bs{batch}_speedup"] > 0 and results[f"spec_{kind}_bs{batch}_identical"] == "2/2"
            assert results[f"spec_{kind}_bs{batch}_partings"] == []
            assert 0 <= results[f"spec_{kind}_bs{batch}_acceptance"] <= 1
        # the model as its own draft (drafts priced as on a launch-bound GPU, so that they are made):
        # every greedy draft is what the target says, unless the steps' rows round differently (a
        # native step of several rows against one of one)
        assert results[f"spec_draft_bs{batch}_acceptance"] > 0.8 and results[f"spec_draft_bs{batch}_draft_step_ms"] > 0
    assert results["decode_bs1_ceiling_tok_s"] > 0
    # async scheduling: the step after a verifying one is launched onto an idle device (read back at once)
    assert re.search(r"batch 1, n-gram speculation steps: .*; [1-9]\d* launches after a step read back at once: host [\d.]+ ms "
                     r"from read back to launch;", r.stdout)
    assert results["spec_ngram_bs1_read_back_launches"] > 0 and results["spec_ngram_bs1_read_back_turnaround_ms"] > 0
    # device speculation's ways in and out (async scheduling: each answer enters on its prompt's samples in flight)
    assert re.search(r"batch 1, n-gram speculation on the device: \d+ device steps \(\d+ request verifications\), (\d+) entries "
                     r"\((\d+) on the samples of a step in flight\), leaves: \d+ for its yield, \d+ other; \d+ requests dropped as "
                     r"they finished \(the others stayed\);", r.stdout)
    device = results["spec_ngram_device_bs1_device"]
    assert device["entries_ahead"] >= 2 and device["entries"] >= device["entries_ahead"] and device["steps"] > device["entries"]
    for batch in (1, 2):  # counted per batch size (the warm-up's and batch 1's steps not in batch 2's)
        assert results[f"spec_ngram_device_bs{batch}_device"]["host_verifications"] >= 0
    assert "spec_ngram_bs1_read_back_idle_ms" not in results  # CUDA events only


def test_an_answer_parting_from_plains_is_shown_with_plains_top_two_gap_there(smollm, llm_gguf_path, quoting_prompts):
    """``parting_gaps``: where an answer parts from the plain engine's, and how close plain's top
    two tokens were there (a near-tie, or a fault): here a plain answer with one token changed."""
    from engine import LLM, SamplingParams
    from engine.bench.speculative import parting_gaps

    core = LLM(str(llm_gguf_path), loaded=smollm, num_kv_blocks=128).core
    group = quoting_prompts[1:3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    want, top = [], []
    for p in group:
        core.add_request(p, params)
        tokens, lps = [], []
        while core.has_unfinished_requests():
            for out in core.step():
                tokens += out.token_ids
                lps += out.logprobs
        want.append(tokens)
        top.append(sorted(lps[5].values(), reverse=True)[:2])
    assert parting_gaps(core, group, want, [list(w) for w in want], 12) == []
    got = [list(w) for w in want]
    got[1][5] += 1
    [(i, at, gap)] = parting_gaps(core, group, want, got, 12)
    assert (i, at) == (1, 5) and gap == pytest.approx(top[1][0] - top[1][1]) and gap >= 0
    got[1] = want[1][:5]  # an answer that stops early parts where it ends
    assert [(i, at) for i, at, _ in parting_gaps(core, group, want, got, 12)] == [(1, 5)]
