"""python -m assistant.eval: fact matching, and a real run on the embedded model."""

from __future__ import annotations

import json
import weakref

import pytest

from assistant.eval import FACTS_FILE, alternatives, contains_fact, grade, load_facts, main, parse_variant, refuses, source_text, stated_numbers

ITEMS = load_facts()
FACTS = [item for item in ITEMS if not item.get("refusal")]
REFUSALS = [item for item in ITEMS if item.get("refusal")]
DAYS = next(f for f in FACTS if f["question_en"] == "How many days of annual leave do I get per year?")
APPLY = next(f for f in FACTS if f["question_en"] == "How do I apply for annual leave?")
HOTEL = next(f for f in FACTS if "hotel limit" in f["question_en"])
BEREAVEMENT = next(r for r in REFUSALS if "bereavement" in r["question_en"])


def graded(answer: str, item: dict, lang: str = "en") -> bool:
    return grade(answer, item, lang, source_text(item, lang))


def test_numbers_match_as_whole_numbers_and_names_case_insensitively():
    assert contains_fact("You need a doctor's note from day 4.", "4")
    assert not contains_fact("Submit it within 14 days.", "4")  # 4 is not in 14
    assert not contains_fact("Version 4.5 of the form", "4")
    assert contains_fact("每周工作37.5小时。", "37.5")
    assert not contains_fact("137.5 hours", "37.5")
    assert contains_fact("use form hr-01 in peoplehub", "HR-01")
    assert contains_fact("第4天起需要医生证明", "4")
    assert graded("Apply with form HR-01 in PeopleHub.", APPLY)
    assert not graded("Apply with form HR-01.", APPLY)


def test_a_list_of_numbers_fails_and_the_right_answer_passes():
    # guesses: 15 and 25 days are in no sentence of the annual-leave document
    assert not graded("You may get 5, 10, 15, 20 or 25 days.", DAYS)
    assert not graded("每年有5天、10天、15天、20天或25天年假。", DAYS, "zh")
    # alternatives fail even when every number is one the document states
    assert not graded("You get 5, 10 or 20 days.", DAYS)
    assert not graded("You get 10 or 20 days a year.", DAYS)
    assert not graded("每年有10天或20天年假。", DAYS, "zh")
    # one invented number is enough to fail
    assert not graded("You get 20 days, and 2 more after 7 years.", DAYS)
    # the right answer passes, with other figures the handbook states, in prose or in a numbered list
    assert graded("Full-time employees get 20 days of paid annual leave per year.", DAYS)
    assert graded("全职员工每年享有20天带薪年假。", DAYS, "zh")
    assert graded("You get 20 days a year and may carry over up to 5 of them to 31 March.", DAYS)
    assert graded("1. Check your balance in PeopleHub.\n2. Submit form HR-01 in PeopleHub.\n3. Give 10 working days' notice.\n"
                  "4. Your manager replies within 3 working days.", APPLY)  # fmt: skip
    assert graded("Hotels up to £150 per night, or up to £200 per night in London.", HOTEL)
    # refusing a question the handbook answers is wrong, even with the figure
    assert not graded("The handbook does not say; maybe 20 days.", DAYS)


def test_what_counts_as_a_number_an_alternative_and_a_refusal():
    assert stated_numbers("Use form HR-01 or FIN-02 on A4 paper by 9:00, 第4天, £1,000") == {"4", "1,000"}
    assert stated_numbers("1. Submit HR-01.\n2) Wait 3 days.\n3、等待") == {"3"}
    assert alternatives("5, 10, 15 days") == ["5, 10, 15 days"] and alternatives("£150 per night, or £200") == []
    assert alternatives("20 days, 5 of them carried over") == []
    assert refuses("The handbook does not say. Ask HR.", "en") and refuses("That is not covered in the handbook.", "en")
    assert refuses("手册中没有说明。请联系HR。", "zh") and not refuses("手册规定每年20天。", "zh")
    assert not refuses("You get 20 days.", "en")
    assert not refuses("Submit HR-01. If the handbook does not say, ask HR.", "en") and not refuses("如果手册没有说明，请联系HR。", "zh")


def test_a_question_the_handbook_does_not_answer_needs_a_refusal_and_the_contact_and_no_invented_number():
    assert graded("The handbook does not say. Please ask HR (hr@northwind.example, extension 1000).", BEREAVEMENT)
    assert graded("手册中没有说明丧假。请联系人力资源部（HR），分机1000。", BEREAVEMENT, "zh")
    assert not graded("You get 5 days of bereavement leave. Ask HR.", BEREAVEMENT)  # invented
    assert not graded("The handbook does not say.", BEREAVEMENT)  # no contact
    assert not graded("The handbook does not say; usually 3 days. Ask HR.", BEREAVEMENT)  # a guess after all
    assert not graded("Ask HR about bereavement leave.", BEREAVEMENT)  # does not say the handbook is silent
    assert not graded("The handbook does not say. Ask the IT Helpdesk.", BEREAVEMENT)  # the wrong contact
    assert not graded("The handbook does not say; see form HR-05.", BEREAVEMENT)  # HR-05 is a form, not HR


def test_the_shipped_questions_cover_both_languages_facts_and_refusals():
    assert len(FACTS) >= 15 and len(REFUSALS) >= 8
    assert all(f["question_en"] and f["question_zh"] and f["answer_contains"] for f in FACTS)
    assert all(r["contact_any"] and not set(r) & {"answer_contains"} for r in REFUSALS)
    for item in ITEMS:  # every number a fact expects is in its document, in both languages
        for lang in ("en", "zh"):
            assert source_text(item, lang)
            assert all(contains_fact(source_text(item, lang), f) for f in item.get("answer_contains", []) if f[0].isdigit())


def test_a_variant_names_the_weights_and_optionally_the_heads_format(capsys):
    """``fp8+fp8-head`` is FP8 layers with an e4m3 head; a variant of unknown parts is a usage error
    naming the choices, before any model loads."""
    assert parse_variant("int4") == ("int4", "none")
    assert parse_variant("fp8+fp8-head") == ("fp8", "fp8")
    assert parse_variant("none+int4-head") == ("none", "int4")
    for bad in ("int8", "fp8+fp8", "fp8+fp8-head+x", "+fp8-head"):
        with pytest.raises(ValueError, match="unknown variant"):
            parse_variant(bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["--quantization", "fp8+bf16-head"])
    assert exit_info.value.code == 2 and "unknown variant 'fp8+bf16-head'" in capsys.readouterr().err


def test_a_bad_facts_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "facts.json"
    bad.write_text('[{"question_en": "x"}]', encoding="utf-8")
    assert main(["--facts", str(bad), "--no-progress"]) == 2
    assert "needs question_en, question_zh, file and either answer_contains or refusal" in capsys.readouterr().err


def test_a_real_run_grades_what_the_assistant_said(tmp_path, capsys, monkeypatch):
    """Two variants in one run, each engine let go before the next is built (on a GPU the next
    sizes its KV cache from the memory the first one leaves free), every answer graded as grade()
    grades it. English only, short answers: a variant's first question prefills the whole handbook
    (2.8k tokens; 5.8k in Chinese, whose grading the tests above cover), most of the run's time."""
    import engine.async_engine

    cores, heads, build = [], [], engine.async_engine.build_engine

    def tracked(config, *args, **kwargs):
        assert all(ref() is None for ref in cores), "the previous variant's engine is still alive"
        core = build(config, *args, **kwargs)
        cores.append(weakref.ref(core))
        heads.append((config.quantization, config.lm_head_quantization))
        return core

    monkeypatch.setattr(engine.async_engine, "build_engine", tracked)
    out = tmp_path / "eval.json"
    assert main(["--quantization", "int4", "none+fp8-head", "--lang", "en", "--limit", "2", "--max-tokens", "24", "--json", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    assert heads == [("int4", "none"), ("none", "fp8")]  # the second variant's head in e4m3 (emulated on the CPU)
    report = json.loads(out.read_text(encoding="utf-8"))
    questions = [f["question_en"] for f in json.loads(FACTS_FILE.read_text("utf-8"))[:2]]
    printed = capsys.readouterr().out
    for variant in ("int4", "none+fp8-head"):
        answers = [a for a in report["answers"] if a["variant"] == variant]
        assert [(a["lang"], a["question"]) for a in answers] == [("en", q) for q in questions]
        for a in answers:
            assert a["answer"].strip() and a["generated_tokens"] > 0
            item = next(i for i in ITEMS if i["question_en"] == a["question"])
            assert a["kind"] == "fact" and a["correct"] == graded(a["answer"], item)
        assert [(r["lang"], r["questions"], r["correct"]) for r in report["summary"] if r["variant"] == variant] == [
            ("en", 2, sum(a["correct"] for a in answers))
        ]
        assert f"| {variant} | en | " in printed


def test_picture_questions_are_grounded_in_the_handbook_and_in_both_languages():
    from assistant.eval_images import PICTURES

    assert len(PICTURES) >= 8 and {p.lang for p in PICTURES} == {"en", "zh"}
    assert {p.kind for p in PICTURES} == {"receipt", "form", "error"}
    for picture in PICTURES:
        item = {"file": picture.file}
        assert all(contains_fact(source_text(item, picture.lang), fact) for fact in picture.answer_contains), picture.name


def test_a_picture_answer_may_quote_the_pictures_numbers_but_not_invent_others():
    from assistant.eval_images import PICTURES

    picture = next(p for p in PICTURES if p.name == "hotel-receipt-manchester")
    item = {"question_en": picture.question, "answer_contains": list(picture.answer_contains), "file": picture.file}
    source = source_text(item, "en") + "\n" + picture.reference
    assert grade("The receipt shows GBP 187.40 for one night; outside London the limit is £150 per night.", item, "en", source)
    assert not grade("The receipt shows GBP 187.40; the limit is £175 per night.", item, "en", source)
    assert not grade("The receipt shows GBP 187.40 for one night; the limit is £150.", item, "en", source_text(item, "en"))


def test_a_picture_over_the_limit_is_not_within_it_whatever_figure_the_answer_names():
    """The London receipt (GBP 214 a night, limit 200): naming 200 is not enough when the answer
    says the room is within the limit; the Chinese Manchester receipt likewise."""
    from assistant.eval_images import PICTURES

    by_name = {p.name: p for p in PICTURES}
    london, zh = by_name["hotel-receipt-london"], by_name["hotel-receipt-zh"]
    assert london.verdict == zh.verdict == by_name["hotel-receipt-manchester"].verdict == "no"
    assert by_name["expense-claim-form"].verdict is None

    def graded(picture, answer: str) -> bool:
        item = {f"question_{picture.lang}": picture.question, "answer_contains": list(picture.answer_contains),
                "file": picture.file, "verdict": picture.verdict}  # fmt: skip
        return grade(answer, item, picture.lang, source_text(item, picture.lang) + "\n" + picture.reference)

    assert graded(london, "No: in London the limit is £200 per night, and this room cost GBP 214.00.")
    assert graded(london, "The London limit is £200 a night; at GBP 214.00 this room is not within it.")
    assert not graded(london, "The handbook's limit per night is £200. The room charge of £214.00 is within the limit.")
    assert not graded(london, "Yes, the London limit is £200 per night.")
    assert graded(zh, "不能全部报销。伦敦以外每晚的住宿上限是150英镑。")
    assert not graded(zh, "可以全部报销，伦敦以外每晚的住宿上限是150英镑。")
    assert not graded(zh, "能全部报销。伦敦以外的上限是150英镑。")
