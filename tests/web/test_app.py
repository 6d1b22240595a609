"""The web page end to end, in real headless Chromium against a real ``python -m web``.

A question is spoken into Chromium's fake microphone (the bundled voice reading the first handbook
question), heard, answered aloud and timed; questions are typed; bad input gets a message and
the page keeps working; push to talk and the stop button work. Screenshots: tests/web/artifacts/.
"""

from __future__ import annotations

import os
import re
import shutil
from urllib.parse import urlparse

import pytest

from assistant.timeline import OPTIONAL_STAGES, STAGES
from tests.conftest import REPO
from tests.web.conftest import screenshot
from web.waterfall import LABELS

pytestmark = pytest.mark.timeout(300)


def expect():
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect


def record(tab) -> None:
    tab.locator("#mic").get_by_role("button", name="Record").click()


def last_turn_row(tab) -> list[str]:
    rows = tab.locator("#turns table tbody tr")
    return [cell.strip() for cell in rows.nth(rows.count() - 1).inner_text().split("\t")]


def test_a_spoken_question_is_heard_answered_aloud_and_timed(page, browser, web_server, question) -> None:
    segments: list[int] = []
    page.on("response", lambda r: segments.append(r.status) if r.url.endswith(".aac") else None)
    record(page)
    # the live transcript, then the question in the conversation with the answer and its source
    expect()(page.locator("#live")).to_contain_text("You said", timeout=30_000)
    expect()(page.locator("#chat")).to_contain_text("apply for annual leave", timeout=30_000)
    expect()(page.locator("#chat")).to_contain_text("Source: 01-annual-leave.md", timeout=60_000)
    # the waterfall of the turn, with every stage, once the answer has been spoken
    expect()(page.locator("#turns")).to_contain_text("voice", timeout=60_000)
    header = page.locator("#turns table thead").inner_text()
    assert all(LABELS[stage] in header.replace("\n", " ") for stage in STAGES[1:]), header
    row = last_turn_row(page)
    cells = dict(zip(STAGES[1:], row[2 : 2 + len(STAGES) - 1], strict=True))
    assert all(cells[stage] == "–" for stage in OPTIONAL_STAGES)  # hands free: nobody asked for the answer
    shares = [float(cell) for stage, cell in cells.items() if stage not in OPTIONAL_STAGES]  # every other stage has one
    assert sum(shares) == pytest.approx(float(row[len(STAGES) + 1]), abs=len(STAGES))
    prompt, cached = (int(n) for n in row[-1].split("/"))
    assert 0 < cached <= prompt
    expect()(page.locator("#waterfall img")).to_be_visible()
    expect()(page.locator("#summary")).to_contain_text("speech end → first audio")
    # the answer audio reached the browser, and the player played it
    assert segments and all(status == 200 for status in segments), segments
    played = page.evaluate("() => Math.max(0, ...[...document.querySelectorAll('#speaker audio')].map((a) => a.currentTime))")
    assert played > 0.5, played
    # the server panel counts this session and shows where memory went
    stats = page.locator("#stats")
    expect()(stats).to_contain_text(re.compile(r"sessions\s+1 / "))
    expect()(stats).to_contain_text("kv_cache")
    expect()(stats).to_contain_text("speech end to first audio")
    shot = screenshot(page, "spoken-question")  # tests/web/artifacts/
    if os.environ.get("UPDATE_DOCS_SCREENSHOT") == "1":  # refresh the README's picture on purpose only
        shutil.copyfile(shot, REPO / "docs" / "web-ui.png")
    # nothing left 127.0.0.1 (no analytics, fonts or CDNs)
    outside = {urlparse(u).netloc for u in browser.requests if urlparse(u).scheme in ("http", "https", "ws", "wss")}
    assert outside <= {urlparse(web_server.url).netloc}, outside


def test_typed_questions_stream_cited_answers_in_one_conversation(page) -> None:
    box = page.locator("#question textarea")
    box.fill("How many days of sick leave can I self-certify?")
    box.press("Enter")
    page.wait_for_function("() => document.querySelector('#chat').innerText.includes('▌')", timeout=30_000)  # streaming
    expect()(page.locator("#chat")).to_contain_text("Source: 02-sick-leave.md", timeout=60_000)
    page.locator("#question textarea").fill("What is the minimum length of a password?")
    page.locator("#ask").click()
    expect()(page.locator("#chat")).to_contain_text("Source: 05-it-accounts-and-passwords.md", timeout=60_000)
    expect()(page.locator("#turns table tbody tr")).to_have_count(2, timeout=30_000)
    first_prompt, first_cached = (int(n) for n in page.locator("#turns table tbody tr").nth(0).inner_text().split("\t")[-1].split("/"))
    second_prompt, second_cached = (int(n) for n in last_turn_row(page)[-1].split("/"))
    assert 0 < first_cached < first_prompt  # the documents prefix came from the cache, the question did not
    assert second_cached >= first_cached - 16 and second_prompt > second_cached  # the same prefix; the rest computed
    assert last_turn_row(page)[1] == "text"
    screenshot(page, "typed-questions")


def test_bad_input_gets_a_message_and_the_page_keeps_working(page, web_server, tmp_path) -> None:
    """An empty question, a file that is not audio, a folder outside the allowed ones, an unreadable document, a
    refused setting: each gets a message, and then a new document is added and asked about."""
    page.locator("#ask").click()
    expect()(page.get_by_text("Type a question first")).to_be_visible()

    not_audio = tmp_path / "notes.txt"
    not_audio.write_text("these are meeting notes, not a recording")
    page.locator("#recording input[type=file]").set_input_files(not_audio)
    expect()(page.get_by_text("is not an audio file")).to_be_visible(timeout=30_000)

    page.get_by_role("tab", name="Documents").click()
    listing = page.locator("#documents")
    expect()(listing).to_contain_text("whole-context")
    status = page.locator("#documents-status")
    page.get_by_label("Answer from this folder").fill("/no/such/folder")
    page.get_by_role("button", name="Use folder").click()
    expect()(status).to_contain_text("/no/such/folder is not under an allowed documents folder", timeout=30_000)
    bad_pdf = tmp_path / "policy.pdf"
    bad_pdf.write_bytes(b"%PDF-1.4\nthis file was cut off")
    page.locator("#upload input[type=file]").set_input_files(bad_pdf)
    expect()(status).to_contain_text("policy.pdf is not a readable PDF", timeout=30_000)
    expect()(listing).not_to_contain_text("policy.pdf")

    parking = tmp_path / "13-parking.md"
    parking.write_text("# Parking\n\n## Parking spaces\n\nEmployees park in garage B with a permit from Facilities (form FAC-7).\n")
    page.locator("#upload input[type=file]").set_input_files(parking)
    expect()(status).to_contain_text("Added 13-parking.md", timeout=60_000)
    expect()(listing).to_contain_text("13-parking.md")
    assert (web_server.documents_dir / "13-parking.md").is_file()
    page.locator("#reload").click()
    expect()(status).to_contain_text("no changes", timeout=30_000)

    # a setting the server refuses (Whisper tiny.en hears only English): a message, nothing changes
    page.get_by_role("tab", name="Settings").click()
    page.get_by_label("Speech language").click()
    page.get_by_role("option", name="zh").click()
    expect()(page.get_by_text("'zh' is not supported by this ASR model")).to_be_visible(timeout=30_000)
    expect()(page.locator("#in-effect")).to_contain_text("speech language en")

    page.locator("#question textarea").fill("Which form do I need for a parking permit?")
    page.locator("#ask").click()
    expect()(page.locator("#chat")).to_contain_text("Source: 13-parking.md", timeout=60_000)
    screenshot(page, "bad-input")


def test_push_to_talk_then_the_stop_button_interrupts_the_answer(page) -> None:
    page.get_by_role("tab", name="Settings").click()
    page.get_by_label("Push to talk (stop recording to ask)").check()
    expect()(page.locator("#in-effect")).to_contain_text("push to talk", timeout=30_000)
    record(page)
    # with no server VAD ending the turn, nothing is answered until the recording stops; the live
    # line shows a partial transcript, which Whisper tiny may still mishear at the end of the clip
    expect()(page.locator("#live")).to_contain_text("You said: How do I apply for", timeout=30_000)
    page.wait_for_timeout(1500)
    expect()(page.locator("#chat")).not_to_contain_text("▌")
    page.locator("#mic").get_by_role("button", name="Stop").click()
    expect()(page.locator("#live")).to_contain_text("Answering", timeout=60_000)
    page.locator("#stop").click()
    expect()(page.locator("#chat")).to_contain_text("(interrupted)", timeout=30_000)
    played = "() => [...document.querySelectorAll('#speaker audio')].map((a) => a.currentTime).join()"
    before = page.evaluate(played)
    page.wait_for_timeout(1000)
    assert page.evaluate(played) == before  # nothing more of the answer is heard
    screenshot(page, "push-to-talk-stopped")


def test_an_uploaded_recording_is_asked_like_speech(page, question_wav) -> None:
    page.locator("#recording input[type=file]").set_input_files(question_wav)
    expect()(page.locator("#chat")).to_contain_text("apply for annual leave? (spoken)", timeout=60_000)
    expect()(page.locator("#chat")).to_contain_text("Source: 01-annual-leave.md", timeout=60_000)
    expect()(page.locator("#turns")).to_contain_text("voice", timeout=30_000)


def test_a_question_about_an_uploaded_picture_shows_it_and_answers_from_its_text(page, tmp_path) -> None:
    from assistant.eval_images import PICTURES, render

    picture = tmp_path / "locked.png"
    picture.write_bytes(render(next(p for p in PICTURES if p.name == "account-locked")))
    page.locator("#picture input[type=file]").set_input_files(str(picture))
    expect()(page.locator("#picture img")).to_have_count(1, timeout=30_000)
    page.locator("#question textarea").fill("How long will my account stay locked?")
    page.locator("#ask").click()
    expect()(page.locator("#chat img")).to_have_count(1, timeout=30_000)  # the picture is in the conversation
    expect()(page.locator("#chat")).to_contain_text("Source: 05-it-accounts-and-passwords.md", timeout=90_000)
    expect()(page.locator("#turns")).to_contain_text("image read", timeout=30_000)
    assert page.locator("#picture img").count() == 0  # sent: the picture box is clear for the next one
    screenshot(page, "picture-question")
