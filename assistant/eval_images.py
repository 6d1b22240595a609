"""Picture questions for the eval, rendered from the handbook's own facts: receipts, forms and
screenshots of errors, in English and Chinese, each with a question whose answer needs both the
picture and the handbook.

:func:`render` draws a :class:`Picture` with Pillow (1,280 px wide, as a phone photo or a
screenshot is), so the eval, the tests and the OCR benchmark read real pixels. Chinese text needs
a CJK font: :func:`cjk_font` finds one with fontconfig (Debian: ``fonts-wqy-microhei`` or
``fonts-noto-cjk``) and says how to install one if there is none.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

WIDTH = 1280


@dataclass(frozen=True)
class Picture:
    """A picture to render: its kind (receipt | form | error), rows of text (a row of two cells is a
    label and its value), and the question asked about it with what a right answer contains."""

    name: str
    kind: str
    rows: tuple[tuple[str, ...], ...]
    question: str
    answer_contains: tuple[str, ...]
    file: str  # the handbook file with the fact
    lang: str = "en"
    verdict: str | None = None  # "no": the picture's amount is over the handbook's limit, and a "yes" answer is wrong

    @property
    def reference(self) -> str:
        """The text drawn, in reading order (the OCR's reference)."""
        return "\n".join(" ".join(row) for row in self.rows)


PICTURES: tuple[Picture, ...] = (
    Picture("hotel-receipt-manchester", "receipt", (
        ("Premier Stay Hotel",), ("14 Deansgate, Manchester M3 2BQ",), ("Receipt no. 58213",),
        ("Date", "12 March 2026"), ("Guest", "A. Employee"), ("Room, 1 night", "GBP 187.40"),
        ("Total paid", "GBP 187.40"), ("Paid by card",), ("Thank you for staying with us",),
    ), "Can I claim this whole hotel bill? What is the limit per night outside London?", ("150",),
        "04-business-travel.md", verdict="no"),  # fmt: skip
    Picture("hotel-receipt-london", "receipt", (
        ("Thames Court Hotel",), ("22 Strand, London WC2N 5HR",), ("Receipt no. 99120",),
        ("Date", "3 April 2026"), ("Room, 1 night", "GBP 214.00"), ("Total paid", "GBP 214.00"),
    ), "Is this London hotel within the limit per night?", ("200",), "04-business-travel.md", verdict="no"),  # fmt: skip
    Picture("meal-receipt", "receipt", (
        ("The Canal Kitchen",), ("Birmingham B1 2HF",), ("Table 7",), ("Dinner for one", "GBP 52.30"),
        ("Total", "GBP 52.30"), ("Card payment approved",),
    ), "How much of this meal can I claim per day on a business trip?", ("40",), "04-business-travel.md"),  # fmt: skip
    Picture("expense-claim-form", "form", (
        ("Expense Claim (FIN-01)",), ("Employee", "A. Employee"), ("Cost centre", "CC-4410"),
        ("Date of expense", "2 February 2026"), ("Item", "Taxi to client office"), ("Amount", "GBP 23.50"),
        ("Receipt attached", "Yes"),
    ), "Within how many days of the expense must I submit this form?", ("30",), "03-expenses-and-reimbursement.md"),  # fmt: skip
    Picture("account-locked", "error", (
        ("PeopleHub sign-in",), ("Your account has been locked",),
        ("There were 5 failed sign-in attempts.",), ("Try again later or reset your password.",),
    ), "My account is locked, what now? How long does the lock last?", ("15",), "05-it-accounts-and-passwords.md"),  # fmt: skip
    Picture("password-expired", "error", (
        ("Northwind sign-in",), ("Your password has expired",), ("Choose a new password to continue.",),
    ), "How often do I have to change my password?", ("180",), "05-it-accounts-and-passwords.md"),  # fmt: skip
    Picture("hotel-receipt-zh", "receipt", (
        ("曼彻斯特快捷酒店",), ("发票号码 58213",), ("日期", "2026年3月12日"), ("住宿 1晚", "187.40 英镑"),
        ("合计", "187.40 英镑"),
    ), "这张酒店发票能全部报销吗？伦敦以外每晚的住宿上限是多少？", ("150",), "04-business-travel.md", "zh", verdict="no"),  # fmt: skip
    Picture("travel-form-zh", "form", (
        ("出差申请表 (FIN-02)",), ("申请人", "王小明"), ("目的地", "上海"), ("出发日期", "2026年5月20日"),
        ("经理审批", "待审批"),
    ), "这张出差申请表需要在出发前至少几天提交？", ("14",), "04-business-travel.md", "zh"),  # fmt: skip
    Picture("password-rules-zh", "error", (
        ("PeopleHub 修改密码",), ("错误：新密码不符合要求",), ("请重新输入密码",),
    ), "新密码至少需要多少个字符？", ("14",), "05-it-accounts-and-passwords.md", "zh"),  # fmt: skip
)


@lru_cache(maxsize=1)
def cjk_font() -> str:
    """The file of a font with Chinese glyphs (fontconfig), or a RuntimeError saying how to get one."""
    if shutil.which("fc-list"):
        out = subprocess.run(["fc-list", ":lang=zh", "file"], capture_output=True, text=True, check=False).stdout
        for file in sorted(line.split(":")[0].strip() for line in out.splitlines()):
            if Path(file).exists():
                return file
    raise RuntimeError("no font with Chinese glyphs: install one, e.g. `apt-get install fonts-wqy-microhei` (or fonts-noto-cjk)")


def render(picture: Picture, size: int = 34) -> bytes:
    """The picture as PNG bytes: a white receipt, a form with a ruled field per row, or a dialog
    with a red title bar; label and value cells far apart, as on the real thing."""
    font = ImageFont.truetype(cjk_font(), size)
    title = ImageFont.truetype(cjk_font(), round(size * 1.25))
    row_h = round(size * 2.0)
    height = max(720, 200 + row_h * len(picture.rows))
    image = Image.new("RGB", (WIDTH, height), "#f4f4f0" if picture.kind == "receipt" else "white")
    draw = ImageDraw.Draw(image)
    y = 80
    if picture.kind == "error":
        draw.rectangle((100, 40, WIDTH - 100, height - 60), outline="#888888", width=3)
        draw.rectangle((100, 40, WIDTH - 100, 40 + row_h + 20), fill="#c0392b")
        y = 58
    for i, row in enumerate(picture.rows):
        face = title if i == 0 else font
        colour = "white" if picture.kind == "error" and i == 0 else "black"
        if picture.kind == "form" and len(row) == 2:
            draw.line((520, y + row_h - 14, WIDTH - 140, y + row_h - 14), fill="#999999", width=2)
        draw.text((160, y), row[0], fill=colour, font=face)
        if len(row) == 2:
            draw.text((560 if picture.kind == "form" else 760, y), row[1], fill=colour, font=face)
        y += row_h + (30 if i == 0 else 0)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def character_error_rate(reference: str, read: str) -> float:
    """Edits per reference character between the text drawn and the text read, with whitespace
    and the layout's ``|`` separators left out (where a reader puts a line break is not an error)."""
    ref, hyp = (re.sub(r"[\s|]+", "", text) for text in (reference, read))
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(1, len(ref))


__all__ = ["PICTURES", "WIDTH", "Picture", "character_error_rate", "cjk_font", "render"]
