"""A picture's sum checked against the handbook's cap, stated beside the question for the model."""

from __future__ import annotations

from assistant.amount_check import amount_note, applicable, limits, rule_line, sums
from assistant.config import HANDBOOK_DIR, SYSTEM_PROMPT
from assistant.docs import load_library
from assistant.eval_images import PICTURES
from assistant.image_reading import ImageText, TextLine, image_prompt, picture_texts
from assistant.prompt import LABELS_EN, LABELS_ZH, PromptBuilder

TRAVEL_EN = (HANDBOOK_DIR / "en" / "04-business-travel.md").read_text(encoding="utf-8").splitlines()
TRAVEL_ZH = (HANDBOOK_DIR / "zh" / "04-business-travel.md").read_text(encoding="utf-8").splitlines()


def picture(name: str):
    return next(p for p in PICTURES if p.name == name)


def test_sums_are_read_as_receipts_and_the_handbook_write_them():
    assert sums("Total paid | GBP 187.40, tip £5 and 1,200.50 英镑 or 150英镑") == [
        (187.40, "GBP 187.40"), (5.0, "£5"), (1200.50, "1,200.50 英镑"), (150.0, "150英镑")]  # fmt: skip
    assert sums("Receipt no. 58213, 12 March 2026") == []  # numbers that are not money


def test_a_line_that_caps_two_sums_gives_one_check_a_clause():
    got = limits("- Hotels up to £150 per night, or up to £200 per night in London.")
    assert [(x.clause, x.amount, x.written) for x in got] == [("Hotels up to £150 per night", 150.0, "£150"),
                                                              ("or up to £200 per night in London", 200.0, "£200")]
    assert limits("- Attach a receipt for every item over £10.") == []  # a threshold, not a cap


def test_the_rule_line_is_the_cap_that_shares_most_words_with_the_picture_and_question():
    hotel = picture("hotel-receipt-london")
    assert "Hotels up to £150" in rule_line(TRAVEL_EN, hotel.question, hotel.reference)
    meal = picture("meal-receipt")
    assert "Meals up to £40" in rule_line(TRAVEL_EN, meal.question, meal.reference)
    assert rule_line(TRAVEL_EN, "Which form do I need?") is None  # no shared word: no check
    assert "酒店每晚不超过150英镑" in rule_line(TRAVEL_ZH, "", picture("hotel-receipt-zh").reference)


def test_over_the_whole_handbook_rare_words_and_the_questions_own_decide_the_line():
    """The meal receipt's "Card payment approved" and the question's "claim" both occur in the home
    office allowance's line; "meal" is rarer, and the question's words count twice, money words not."""
    every_line = [line for path in sorted((HANDBOOK_DIR / "en").glob("*.md")) for line in path.read_text(encoding="utf-8").splitlines()]
    meal = picture("meal-receipt")
    assert "Meals up to £40" in rule_line(every_line, meal.question, meal.reference)
    manchester = picture("hotel-receipt-manchester")
    assert "Hotels up to £150" in rule_line(every_line, "Can I claim this?", manchester.reference)  # the picture alone names it


def test_the_clause_checked_is_the_exception_the_picture_shows_else_the_rule():
    hotels = limits(TRAVEL_EN[next(i for i, line in enumerate(TRAVEL_EN) if "Hotels up to" in line)])
    assert applicable(hotels, picture("hotel-receipt-london").reference).amount == 200  # the receipt says London
    assert applicable(hotels, picture("hotel-receipt-manchester").reference).amount == 150
    assert applicable(hotels[:1], "anything").amount == 150


def test_the_note_says_over_or_within_and_what_follows_in_the_language_of_the_handbook():
    london = picture("hotel-receipt-london")
    assert amount_note([london.reference], london.question, TRAVEL_EN, LABELS_EN.amount) == (
        "Checked: the picture's amount, GBP 214.00, is more than the £200 of \"or up to £200 per night in London\": it cannot "
        "all be claimed, at most £200.")  # fmt: skip
    manchester = picture("hotel-receipt-manchester")
    note = amount_note([manchester.reference], manchester.question, TRAVEL_EN, LABELS_EN.amount)
    assert "more than the £150 of \"Hotels up to £150 per night\"" in note and "London" not in note
    cheap = manchester.reference.replace("187.40", "120.00")
    assert amount_note([cheap], manchester.question, TRAVEL_EN, LABELS_EN.amount).endswith(
        "GBP 120.00, is not more than the £150 of \"Hotels up to £150 per night\": it is within the limit.")
    zh = picture("hotel-receipt-zh")
    assert amount_note([zh.reference], zh.question, TRAVEL_ZH, LABELS_ZH.amount) == (
        "核对：图片中的金额187.40 英镑高于“酒店每晚不超过150英镑”中的150英镑：不能全部报销，最多报销150英镑。")
    form = picture("expense-claim-form")  # a sum, but the question is not about money
    lines = (HANDBOOK_DIR / "en" / form.file).read_text(encoding="utf-8").splitlines()
    assert amount_note([form.reference], form.question, lines + TRAVEL_EN, LABELS_EN.amount) == ""
    assert amount_note([], "Is £500 the hotel limit?", TRAVEL_EN, LABELS_EN.amount) == ""  # the user's own numbers are not a picture


def test_the_prompt_states_the_check_after_the_question_and_before_the_nudge(llm_gguf_path):
    from engine.tokenizer import Tokenizer

    builder = PromptBuilder(Tokenizer.load(llm_gguf_path), SYSTEM_PROMPT, load_library(HANDBOOK_DIR)["en"])
    london = picture("hotel-receipt-london")
    lines = tuple(TextLine(row, 0.99, (0, 40 * i, 900, 40 * i + 30)) for i, row in enumerate(london.reference.splitlines()))
    question = image_prompt([ImageText("d", (1280, 720), lines, 1.0)], london.question)
    assert picture_texts(question) == [london.reference]
    content = builder.prompt([], question).content
    assert content.endswith(f"{london.question}\nChecked: the picture's amount, GBP 214.00, is more than the £200 of \"or up to £200 "
                            f"per night in London\": it cannot all be claimed, at most £200.\n{LABELS_EN.nudge}")
    plain = builder.prompt([], "How much can I spend on a hotel in London?").content
    assert "Checked:" not in plain
