"""python -m assistant.eval: fact matching, and a real run on the embedded model."""

from __future__ import annotations

import json

from assistant.eval import FACTS_FILE, contains_fact, is_correct, load_facts, main, other_numbers


def test_numbers_match_as_whole_numbers_and_names_case_insensitively():
    assert contains_fact("You need a doctor's note from day 4.", "4")
    assert not contains_fact("Submit it within 14 days.", "4")  # 4 is not in 14
    assert not contains_fact("Version 4.5 of the form", "4")
    assert contains_fact("每周工作37.5小时。", "37.5")
    assert not contains_fact("137.5 hours", "37.5")
    assert contains_fact("use form hr-01 in peoplehub", "HR-01")
    assert contains_fact("第4天起需要医生证明", "4")
    assert is_correct("Apply with form HR-01 in PeopleHub.", ["HR-01", "PeopleHub"])
    assert not is_correct("Apply with form HR-01.", ["HR-01", "PeopleHub"])


def test_a_list_of_numbers_does_not_pass_by_accident():
    assert not is_correct("You may get 5, 10, 15, 20 or 25 days.", ["20"])
    assert not is_correct("每年有5天、10天、15天、20天或25天年假。", ["20"])
    # a real answer may cite a few other numbers; codes and times are not counted as numbers
    assert is_correct("You get 20 days a year, can carry over 5, and apply 2 weeks ahead with HR-01 by 9:00.", ["20"])
    assert other_numbers("Use form HR-01 or FIN-02 on A4 paper, 第4天", []) == {"4"}


def test_the_shipped_facts_cover_both_languages():
    facts = load_facts()
    assert len(facts) >= 15
    assert all(f["question_en"] and f["question_zh"] and f["answer_contains"] for f in facts)


def test_a_bad_facts_file_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "facts.json"
    bad.write_text('[{"question_en": "x"}]', encoding="utf-8")
    assert main(["--facts", str(bad), "--no-progress"]) == 2
    assert "needs question_en, question_zh and answer_contains" in capsys.readouterr().err


def test_a_real_run_grades_what_the_assistant_said(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["--quantization", "int4", "--lang", "en", "zh", "--limit", "2", "--max-tokens", "48", "--json", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    answers = report["answers"]
    assert [(a["lang"], a["question"]) for a in answers] == [
        (lang, f[f"question_{lang}"]) for lang in ("en", "zh") for f in json.loads(FACTS_FILE.read_text("utf-8"))[:2]
    ]
    for a in answers:
        assert a["answer"].strip() and a["generated_tokens"] > 0
        assert a["correct"] == is_correct(a["answer"], a["expected"])
    assert [(r["lang"], r["questions"], r["correct"]) for r in report["summary"]] == [
        (lang, 2, sum(a["correct"] for a in answers if a["lang"] == lang)) for lang in ("en", "zh")
    ]
    assert "| int4 | en |" in capsys.readouterr().out
