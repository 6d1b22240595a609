"""A session's history: appended after the shared prefix (so it is cached), trimmed oldest-first to fit."""

from __future__ import annotations

from itertools import pairwise

import pytest

from assistant.answerer import Answerer
from assistant.config import HANDBOOK_DIR, SYSTEM_PROMPT, AssistantConfig, EngineOptions, RefusalConfig
from assistant.conversation import Conversation, Turn, group_turns, oldest_first_cuts
from assistant.docs import load_library
from assistant.prompt import WHOLE, ContextBudget, PromptBuilder, PromptTooLong

BLOCK = 16  # the engine's KV block size: the prefix cache works in whole blocks


@pytest.fixture(scope="module")
def tokenizer(llm_gguf_path):
    from engine.tokenizer import Tokenizer

    return Tokenizer.load(llm_gguf_path)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_a_conversation_is_its_turns_as_chat_messages():
    conversation = Conversation()
    conversation.add("q1", "a1")
    conversation.add("q2", "a2")
    assert conversation.messages() == [user("q1"), assistant("a1"), user("q2"), assistant("a2")]
    conversation.drop_oldest(1)
    assert conversation.turns == [Turn("q2", "a2")]


def test_history_is_cut_a_whole_turn_at_a_time_oldest_first():
    history = [user("q1"), assistant("a1"), user("q2"), assistant("a2a"), assistant("a2b"), user("q3")]
    assert group_turns(history) == [[user("q1"), assistant("a1")], [user("q2"), assistant("a2a"), assistant("a2b")], [user("q3")]]
    cuts = list(oldest_first_cuts(history))
    assert [dropped for _, dropped in cuts] == [0, 1, 2, 3]
    assert [kept for kept, _ in cuts] == [history, history[2:], history[5:], []]


def test_the_next_turns_prompt_shares_the_prefix_and_the_earlier_turns(tokenizer):
    builder = PromptBuilder(tokenizer, SYSTEM_PROMPT, load_library(HANDBOOK_DIR)["en"])
    first = builder.build([], "How do I apply for annual leave?")
    history = [user("How do I apply for annual leave?"), assistant("Submit form HR-01 in PeopleHub.")]
    second = builder.build(history, "And how many days do I get?")
    third = builder.build([*history, user("And how many days do I get?"), assistant("20 days a year.")], "Thanks!")
    prefix = len(builder.prefix.token_ids)
    assert first[:prefix] == second[:prefix] == third[:prefix]
    # the history holds each question as asked (its sections went with it once): the turns before
    # the newest are a shared start of the next prompts, so their KV is cached too
    shared = next(i for i, (a, b) in enumerate(zip(second, third)) if a != b)
    text = tokenizer.decode(third[:shared], skip_special_tokens=False)
    assert text.endswith("How do I apply for annual leave?<|im_end|>\n<|im_start|>assistant\nSubmit form HR-01 in PeopleHub.<|im_end|>\n<|im_start|>user\n")


def test_a_long_conversation_never_exceeds_the_context_and_keeps_the_prefix(tokenizer):
    budget = ContextBudget(max_model_len=4096, max_tokens=160, conversation_tokens=1024)
    builder = PromptBuilder(tokenizer, SYSTEM_PROMPT, load_library(HANDBOOK_DIR)["en"], budget=budget)
    assert builder.mode == WHOLE
    prefix = list(builder.prefix.token_ids)
    conversation, dropped_total = Conversation(), 0
    for i in range(30):
        question = f"Question {i}: tell me everything about annual leave, sick leave and expenses."
        prompt = builder.prompt(conversation.messages(), question)
        assert len(prompt.token_ids) <= budget.prompt_limit
        assert prompt.token_ids[: len(prefix)] == prefix
        conversation.drop_oldest(prompt.dropped_turns)
        dropped_total += prompt.dropped_turns
        conversation.add(question, f"Answer {i}: " + "The handbook says to apply in PeopleHub. " * 20)
    assert dropped_total > 10  # trimming really happened, and only the newest turns are left
    assert conversation.turns[-1].question.startswith("Question 29") and len(conversation.turns) == 30 - dropped_total
    with pytest.raises(PromptTooLong, match="at most"):
        builder.prompt([], "leave " * 2000)


@pytest.fixture(scope="module")
def answerer(tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs")
    (docs / "leave.md").write_text(
        "# Annual leave\n\n## Entitlement\nEmployees get 20 days of annual leave.\n\n"
        "## How to apply\nApply with form HR-01 in PeopleHub.\n",
        encoding="utf-8",
    )
    answerer = Answerer.create(
        # follow-ups ("Where do I submit it?") use words this one-page folder lacks: the model answers them (gate off)
        AssistantConfig(docs_dir=docs, max_tokens=12, conversation_tokens=256, engine=EngineOptions(max_model_len=512),
                        refusal=RefusalConfig(enabled=False))
    )
    yield answerer
    answerer.shutdown()


async def ask(answerer: Answerer, question: str, conversation: Conversation):
    async for delta in answerer.answer(question, conversation):
        if delta.finished:
            return delta
    raise AssertionError("no final delta")


async def test_earlier_turns_are_cached_and_the_conversation_keeps_them(answerer):
    conversation = Conversation()
    questions = ["How many days of annual leave do I get?", "Which form do I use?", "Where do I submit it?"]
    finals = [await ask(answerer, q, conversation) for q in questions]
    assert [t.question for t in conversation.turns] == questions
    assert all(t.answer for t in conversation.turns)
    # each turn reuses the prefix and every turn before the newest (whole blocks of them, answers
    # included): the history holds each user message as it was sent, its document included
    builder = answerer.builders[answerer.language_for(questions[0])]
    prefix = len(builder.prefix.token_ids) // BLOCK * BLOCK
    assert all(f.cached_tokens >= prefix for f in finals[1:])
    for before, after in pairwise(finals):
        assert after.cached_tokens >= before.cached_tokens
    assert finals[2].cached_tokens > finals[1].cached_tokens
    assert "Employees get 20 days" in conversation.turns[0].content
    # the follow-up's document is already in the conversation: not repeated, and all the follow-up
    # computes is its own message (the question and the nudge, a few template tokens, a block's remainder)
    assert conversation.turns[1].content == f"{builder.labels.question}{questions[1]}\n{builder.labels.nudge}"
    assert finals[1].prompt_tokens - finals[1].cached_tokens <= BLOCK + 32
    assert conversation.messages()[0]["content"] == conversation.turns[0].content


async def test_a_long_conversation_is_trimmed_to_the_engines_context(answerer):
    conversation = Conversation()
    for i in range(6):
        final = await ask(answerer, f"Question {i}: " + "tell me about annual leave and forms. " * 12, conversation)
        assert final.finish_reason in ("stop", "length")
        assert final.prompt_tokens + answerer.config.max_tokens <= 512
    assert 1 <= len(conversation.turns) < 6  # older turns were dropped, the newest kept
    assert conversation.turns[-1].question.startswith("Question 5")
