"""The refusal gate over the real bundled handbook and its real retrieval; one answer through the
real Answerer with the embedded SmolLM2, where the refusal spends no model tokens."""

from __future__ import annotations

import pytest

from assistant.answerer import Answerer
from assistant.config import HANDBOOK_DIR, AssistantConfig, EngineOptions, RefusalConfig
from assistant.conversation import Conversation
from assistant.docs import load_library
from assistant.eval import FACTS_FILE, gate_verdicts, load_facts, names, refuses
from assistant.refusal import RefusalGate
from assistant.retrieval import SectionIndex

COLLOQUIAL_FILE = FACTS_FILE.with_name("eval_colloquial.json")
CONTACTS = "12-who-to-contact.md"


@pytest.fixture(scope="module")
def library():
    return load_library(HANDBOOK_DIR)


def gate(docs, config: RefusalConfig | None = None) -> RefusalGate:
    return RefusalGate(docs, SectionIndex(docs.sections), config or RefusalConfig())


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_every_eval_question_the_handbook_does_not_answer_is_refused_and_no_fact_is(lang):
    verdicts = gate_verdicts(load_facts(), [lang])
    refusals = [v for v in verdicts if v.kind == "refusal"]
    facts = [v for v in verdicts if v.kind == "fact"]
    assert len(refusals) == 8 and len(facts) == 17
    assert [v.question for v in refusals if not v.refused] == []
    assert [v.question for v in facts if v.refused] == []
    # graded as the full eval grades a refusal (names the topic's contact): 7/8 in each language since a
    # Chinese substring counts as words by its length (the VPN question's 家办公, "home office", is two)
    assert sum(v.graded for v in refusals) >= 7


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_colloquial_questions_written_apart_from_the_eval_stay_within_the_measured_rates(lang):
    """Measured when the gate was written: refusals caught 7/8 en, 8/8 zh; false refusals 3/16 en
    (maternity, show up, USB stick), 5/16 zh (产假, 生病, 打车, 弄丢, 补休): synonyms the handbook
    does not use. A change to the gate that does worse fails here."""
    verdicts = gate_verdicts(load_facts(COLLOQUIAL_FILE), [lang])
    refusals = [v for v in verdicts if v.kind == "refusal"]
    facts = [v for v in verdicts if v.kind == "fact"]
    assert (len(refusals), len(facts)) == (8, 16)
    assert sum(v.refused for v in refusals) >= 7
    assert sum(v.refused for v in facts) <= {"en": 3, "zh": 5}[lang]


@pytest.mark.parametrize(
    ("lang", "question", "contact"),
    [
        ("en", "How many days of bereavement leave do I get?", "hr@northwind.example"),
        ("en", "Can I keep the air miles from business flights?", "travel@northwind.example"),
        ("zh", "丧假有几天？", "hr@northwind.example"),
        ("zh", "可以把机密文件粘贴到AI聊天机器人里吗？", "security@northwind.example"),
        ("zh", "在家办公需要安装哪个VPN客户端？", "helpdesk@northwind.example"),
    ],
)
def test_a_refusal_says_so_in_the_questions_language_and_names_a_contact_from_the_handbook(library, lang, question, contact):
    refusal = gate(library[lang]).refusal(question)
    assert refusal is not None
    assert refuses(refusal.text, lang) and names(refusal.text, contact)
    assert contact in (HANDBOOK_DIR / lang / CONTACTS).read_text(encoding="utf-8")
    assert refusal.citation is not None and refusal.citation.path == CONTACTS
    assert refusal.citation.heading in refusal.text


def test_the_evidence_separates_question_words_from_the_unknown_topic(library):
    evidence = gate(library["en"]).evidence("How many days of bereavement leave do I get?")
    assert evidence.unknown == ("bereavement",) and "many" not in evidence.units
    assert evidence.uncovered_share >= RefusalConfig().uncovered_share
    zh = gate(library["zh"]).evidence("丧假有几天？")
    assert zh.unknown == ("丧假",) and zh.uncovered_share == 1.0
    # every word known: never refused, however the words are spread over the handbook
    known = gate(library["en"]).evidence("How many days of annual leave do I get per year?")
    assert known.unknown == () and gate(library["en"]).refusal("How many days of annual leave do I get per year?") is None


@pytest.mark.parametrize(("lang", "turn"), [("en", "Hello?"), ("en", "Thanks!"), ("en", "Can you repeat that?"), ("zh", "谢谢！")])
def test_a_turn_of_conversation_words_only_is_left_to_the_model(library, lang, turn):
    assert gate(library[lang]).refusal(turn) is None


def test_the_switch_and_the_threshold_are_the_configs(library):
    question = "What is the dress code at the office?"
    assert gate(library["en"], RefusalConfig(enabled=False)).refusal(question) is None
    share = gate(library["en"]).evidence(question).uncovered_share
    assert gate(library["en"], RefusalConfig(uncovered_share=share)).refusal(question) is not None
    assert gate(library["en"], RefusalConfig(uncovered_share=min(1.0, share + 0.01))).refusal(question) is None
    with pytest.raises(ValueError, match="uncovered_share"):
        AssistantConfig(refusal=RefusalConfig(uncovered_share=0.0)).validate()


def test_a_handbook_without_contacts_refuses_without_naming_one(tmp_path):
    (tmp_path / "leave.md").write_text("# Leave\n\n## Entitlement\nEmployees get 20 days of annual leave.\n", encoding="utf-8")
    docs = load_library(tmp_path)["any"]
    refusal = gate(docs).refusal("Is there a gym at the office?")
    assert refusal is not None and refusal.text == "The handbook does not say." and refusal.citation is None
    assert gate(docs).refusal("How many days of annual leave do I get?") is None


@pytest.fixture(scope="module")
def answerer():
    """The real answering path: the bundled handbook, the embedded SmolLM2 (the tests' default LLM)."""
    answerer = Answerer.create(AssistantConfig(max_tokens=8, engine=EngineOptions(max_model_len=4096)))
    yield answerer
    answerer.shutdown()


async def deltas(answerer: Answerer, question: str, history=None, **kwargs) -> list:
    return [d async for d in answerer.answer(question, history, **kwargs)]


@pytest.mark.parametrize(("lang", "question"), [("en", "What is the dress code at the office?"), ("zh", "丧假有几天？")])
async def test_a_refused_question_streams_the_refusal_like_an_answer_with_no_model_tokens(answerer, lang, question):
    before = answerer.engine.stats()
    conversation = Conversation()
    out = await deltas(answerer, question, conversation)
    after = answerer.engine.stats()
    text, final = "".join(d.text for d in out), out[-1]
    assert [d.finished for d in out] == [False, True] and out[0].text  # a text delta, then the final one
    assert refuses(text, lang) and "hr@northwind.example" in text
    assert final.finish_reason == "stop" and final.citation is not None and final.citation.path == CONTACTS
    assert (final.prompt_tokens, final.generated_tokens) == (0, 0)
    assert final.docs_version == answerer.library[lang].version and final.ttft_s is not None
    assert (after.prompt_tokens, after.generation_tokens, after.num_steps) == (before.prompt_tokens, before.generation_tokens, before.num_steps)
    assert [(t.question, t.answer) for t in conversation.turns] == [(question, text)]


async def test_the_same_question_reaches_the_model_with_the_gate_off_for_the_turn(answerer):
    """``gate=False`` (a turn with a picture) asks the model: the engine does spend tokens on it."""
    out = await deltas(answerer, "What is the dress code at the office?", gate=False)
    assert out[-1].finished and out[-1].generated_tokens > 0 and out[-1].prompt_tokens > 0
