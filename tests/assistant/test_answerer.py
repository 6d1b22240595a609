"""The Answerer on the real engine: documents reloaded on change, retrieval mode, citations."""

from __future__ import annotations

import json
import os
import threading

import pytest

from assistant.answerer import AnswerDelta, Answerer
from assistant.config import AssistantConfig, EngineOptions
from assistant.conversation import Conversation
from assistant.docs import DocumentError
from assistant.eval import FACTS_FILE
from assistant.prompt import RETRIEVAL, WHOLE, PromptTooLong

FACTS = [f for f in json.loads(FACTS_FILE.read_text(encoding="utf-8")) if not f.get("refusal")]
LEAVE = "# Annual leave\n\n## Entitlement\nEmployees get 20 days of annual leave.\n"
FORMS = "# Forms\n\n## Leave form\nApply for leave with form HR-01 in PeopleHub.\n"


async def final(answerer: Answerer, question: str, history=None) -> AnswerDelta:
    async for delta in answerer.answer(question, history):
        if delta.finished:
            return delta
    raise AssertionError("no final delta")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """An answerer over a folder the tests edit (it reloads on use), with a small context."""
    root = tmp_path_factory.mktemp("docs")
    (root / "a-leave.md").write_text(LEAVE, encoding="utf-8")
    answerer = Answerer.create(AssistantConfig(docs_dir=root, max_tokens=6, conversation_tokens=128, engine=EngineOptions(max_model_len=512)))
    yield answerer
    answerer.shutdown()


def edit(path, text: str) -> None:
    """Write ``text`` and move the mtime on, so the change is seen even within one clock tick."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(before + 10**9, before + 10**9))


async def test_an_edited_folder_is_reloaded_with_a_new_version_and_never_mixes_cached_kv(small):
    root = small.config.docs_dir
    assert small.modes == {"any": WHOLE}
    first = await final(small, "How many days of annual leave do I get?")
    assert first.docs_version == small.library["any"].version and first.mode == WHOLE
    assert first.citation is not None and first.citation.path == "a-leave.md"
    again = await final(small, "How many days of annual leave do I get?")
    assert again.docs_version == first.docs_version and again.cached_tokens > 0

    edit(root / "a-leave.md", LEAVE + "\n## Parking\nParking at the office costs 7 pounds a day.\n")
    changed = await final(small, "How many days of annual leave do I get?")
    assert changed.docs_version != first.docs_version
    # the new prefix starts with the same tokens as the old one, yet nothing is reused: the
    # version is an extra key of the prefix cache
    assert changed.cached_tokens == 0
    parking = await final(small, "How much does parking cost?")
    assert parking.citation is not None and parking.citation.heading == "Parking"
    assert parking.cached_tokens > 0  # the new version's prefix is cached from here on

    assert small.reload() is False  # explicit reload: nothing changed
    edit(root / "b-forms.md", FORMS)
    assert small.reload() is True and len(small.library["any"].documents) == 2


async def test_a_broken_edit_keeps_the_old_documents_in_service(small, caplog):
    version = small.library["any"].version
    (small.config.docs_dir / "c-broken.md").write_bytes(b"\xff\xfe\x00bad")
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! Ask me about the handbook."}]
    delta = await final(small, "How many days of annual leave do I get?", history)  # a plain message list works too
    assert delta.docs_version == version
    assert "cannot be loaded" in caplog.text
    with pytest.raises(DocumentError, match="not UTF-8"):
        small.reload()
    (small.config.docs_dir / "c-broken.md").unlink()


@pytest.fixture(scope="module")
def retrieval():
    """The bundled handbook in a 2048-token context: too small for it whole, so retrieval mode."""
    answerer = Answerer.create(AssistantConfig(max_tokens=16, engine=EngineOptions(max_model_len=2048)))
    yield answerer
    answerer.shutdown()


async def test_retrieval_mode_answers_and_cites_in_both_languages_and_shares_the_stable_prefix(retrieval):
    assert retrieval.modes == {"en": RETRIEVAL, "zh": RETRIEVAL}
    engine_config = retrieval.engine.core.config
    assert engine_config.mixed_cuda_graph_max_graphs == 0  # no capture stalls a turn while serving
    # a question while answers decode is a start-up graph on CUDA, whatever the number of answers; on the
    # CPU (no graphs) the scheduler keeps putting several prompts in a step
    assert engine_config.mixed_cuda_graph_start_chunk == 0 and engine_config.mixed_cuda_graph_max_decodes >= engine_config.max_num_seqs
    assert retrieval.engine.core.scheduler.config.beside_decodes_max_chunk == 0
    for lang in ("en", "zh"):
        stable = len(retrieval.builders[lang].prefix.token_ids)
        deltas = [await final(retrieval, f[f"question_{lang}"]) for f in (FACTS[0], FACTS[7])]
        for delta, fact in zip(deltas, (FACTS[0], FACTS[7])):
            assert delta.mode == RETRIEVAL and delta.generated_tokens > 0
            assert delta.prompt_tokens + 16 <= 2048
            assert delta.citation is not None and delta.citation.path == fact["file"]
        # a different question reuses the stable part (system prompt + contents), not more
        assert stable // 16 * 16 <= deltas[1].cached_tokens < deltas[1].prompt_tokens


async def test_a_question_longer_than_the_context_is_refused_before_it_is_queued(retrieval):
    with pytest.raises(PromptTooLong):
        await final(retrieval, "annual leave " * 1500)


def test_a_context_too_small_for_the_stable_prefix_fails_at_start_and_stops_its_engine():
    engines = sum(t.name == "engine-loop" for t in threading.enumerate())
    with pytest.raises(DocumentError, match="cannot hold"):
        Answerer.create(AssistantConfig(max_tokens=16, conversation_tokens=1500, engine=EngineOptions(max_model_len=1024)))
    assert sum(t.name == "engine-loop" for t in threading.enumerate()) == engines


async def test_a_per_answer_token_cap_ends_with_length_and_still_cites(small):
    """``max_tokens`` (a client's max_output_tokens) is the engine's own limit: the answer
    finishes as "length", not as an abort, is recorded and cited."""
    conversation = Conversation()
    deltas = [d async for d in small.answer("How many days of annual leave do I get?", conversation, max_tokens=2)]
    last = deltas[-1]
    assert last.finished and last.finish_reason == "length" and last.generated_tokens == 2
    assert last.citation is not None and last.citation.path == "a-leave.md"
    assert len(conversation.turns) == 1


def test_quantization_auto_runs_the_embedded_gguf_as_int4(small):
    """On the CPU the embedded Q4_1 GGUF runs through the int4 kernels unless told otherwise."""
    from assistant.answerer import default_model_path, resolve_quantization
    from engine.quantization import Int4Linear

    assert small.engine.core.config.quantization == "int4"
    assert any(isinstance(m, Int4Linear) for m in small.engine.core.model.modules())
    gguf = default_model_path()
    assert resolve_quantization(EngineOptions(), gguf) == "int4"
    assert resolve_quantization(EngineOptions(dtype="float32"), gguf) == "none"  # int4 needs bf16 activations
    assert resolve_quantization(EngineOptions(quantization="none"), gguf) == "none"
    assert resolve_quantization(EngineOptions(), "/models/llama-dir") == "none"  # not a GGUF


def test_quantization_auto_runs_a_qwen2_k_quant_gguf_as_int4(qwen_0_5b_gguf):
    """Qwen2.5's Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0 matrices, repacked by engine/gguf_blocks.py) runs int4."""
    from assistant.answerer import resolve_quantization

    assert resolve_quantization(EngineOptions(device="cpu"), str(qwen_0_5b_gguf)) == "int4"


async def test_warming_the_documents_caches_each_documents_part_of_a_question(tmp_path):
    """After ``warm_documents`` a question about any document finds the prefix and that document's
    part of its prompt (repeated in front of the question) in the prefix cache; without warming
    a first question about it finds only the shared prefix."""
    (tmp_path / "a-leave.md").write_text(LEAVE * 3, encoding="utf-8")
    (tmp_path / "b-forms.md").write_text(FORMS * 3, encoding="utf-8")
    answerer = Answerer.create(AssistantConfig(docs_dir=tmp_path, max_tokens=2, conversation_tokens=128, engine=EngineOptions(max_model_len=1024)))
    try:
        builder, block = answerer.builders["any"], answerer.engine.core.config.block_size
        prefix = len(builder.prefix.token_ids)
        await final(answerer, "How many days of annual leave do I get?")  # caches the prefix (and the leave page)
        cold = await final(answerer, "Which form do I use in PeopleHub?")
        assert cold.citation.path == "b-forms.md" and prefix - block <= cold.cached_tokens < prefix + block
        edit(tmp_path / "b-forms.md", FORMS * 3 + "\n## Where\nAll forms are in PeopleHub.\n")  # a new version: nothing above is reused
        assert answerer.reload()
        assert await answerer.warm_documents() == 2
        warm_prompt = answerer.builders["any"].warm_prompts()[1]
        question = answerer.prompt_ids("Which form do I use in PeopleHub?", [])
        shared = next(i for i, (a, b) in enumerate(zip(warm_prompt, question)) if a != b)  # up to the question's text
        warm = await final(answerer, "Which form do I use in PeopleHub?")
        assert warm.citation.path == "b-forms.md" and warm.cached_tokens >= shared - block > prefix + block
        # the answer's form precedes the question, so it is warmed too: what is left is the question's words,
        # the short nudge and the chat template's few tokens after them (plus at most a block's remainder)
        rest = answerer.engine.tokenizer.decode(question[shared:])
        assert builder.labels.reminder not in rest and rest.lstrip().startswith("Which form") and builder.labels.nudge in rest
        assert warm.prompt_tokens - warm.cached_tokens <= block + len(question) - shared
    finally:
        answerer.shutdown()
