"""The image stage's speed: ``python -m assistant.image_bench``.

Times reading a phone-photo-sized picture (1,280 px wide, 15 lines of text: an expense claim
form with its receipt lines, rendered from the handbook's facts) through the image stage as the
server runs it (decode and check, then OCR), and prints p50/p90 next to a baseline measured in
the same run: the OCR library with its own defaults (detection on the image's shorter side
scaled to 736 px and up, the angle classifier on). Also the character error rate of each and
what an identical picture costs the second time (the content-hash cache).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from assistant.eval_images import Picture, character_error_rate, render
from assistant.image_reading import ImageReading, ImageText, OcrReader, TextLine, bgr, open_image, text_lines

PICTURE = Picture("expense-claim-15-lines", "form", (
    ("Expense Claim (FIN-01)",), ("Employee", "A. Employee"), ("Cost centre", "CC-4410"), ("Line manager", "J. Smith"),
    ("Trip", "Manchester client visit"), ("Date of expense", "12 March 2026"), ("Hotel, 1 night", "GBP 187.40"),
    ("Train, return", "GBP 96.20"), ("Taxi", "GBP 23.50"), ("Dinner", "GBP 38.10"), ("Total", "GBP 345.20"),
    ("Receipts attached", "4"), ("Submitted", "20 March 2026"), ("Approved by", "pending"),
    ("Paid with salary on the 25th",),
), "", (), "03-expenses-and-reimbursement.md")  # fmt: skip


class LibraryDefaults(OcrReader):
    """The baseline: rapidocr-onnxruntime's own pipeline exactly as it comes (its config.yaml:
    detection at the size it picks, the angle classifier, batched recognition), threads as ours."""

    name = "rapidocr-defaults"

    def _load(self) -> object:
        from rapidocr_onnxruntime import RapidOCR

        return RapidOCR(**{f"{part}_intra_op_num_threads": self.threads or -1 for part in ("det", "cls", "rec")})

    def read(self, image: Image.Image) -> list[TextLine]:
        if self._ocr is None:
            self._ocr = self._load()
        result, _ = self._ocr(bgr(image))  # type: ignore[operator]
        result = result or []
        return text_lines([box for box, _, _ in result], [(text, score) for _, text, score in result], self.min_score)


def time_readers(readers: list[OcrReader], data: bytes, runs: int) -> list[tuple[list[float], list[TextLine]]]:
    """Per reader, ms per read (decode, check and scale included, as the stage does it) and the
    lines of its last read, after one warm-up read each. The readers take turns, run by run, so
    a change in the machine's load falls on all of them alike."""
    lines = [reader.read(open_image(data)) for reader in readers]
    times: list[list[float]] = [[] for _ in readers]
    for _ in range(runs):
        for i, reader in enumerate(readers):
            start = time.perf_counter()
            lines[i] = reader.read(open_image(data))
            times[i].append((time.perf_counter() - start) * 1000)
    return list(zip(times, lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m assistant.image_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--runs", type=int, default=10, help="timed reads per variant (default 10, after one warm-up)")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads per model (default 0: its own choice)")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be >= 1")
    data = render(PICTURE)
    size = open_image(data).size
    print(f"picture: {size[0]}x{size[1]} px, {len(PICTURE.rows)} lines, {len(data) / 1024:.0f} KiB PNG; "
          f"{os.cpu_count()} CPUs, {a.runs} runs each", flush=True)  # fmt: skip
    rows = []
    readers = [OcrReader(a.threads), LibraryDefaults(a.threads)]
    for reader, (times, lines) in zip(readers, time_readers(readers, data, a.runs)):
        text = ImageText("", size, tuple(lines), 0.0)
        cer = character_error_rate(PICTURE.reference, text.text)
        rows.append({"reader": reader.name, "p50_ms": statistics.median(times), "p90_ms": float(np.percentile(times, 90)),
                     "min_ms": min(times), "lines_read": len(text.rows), "cer": cer, "times_ms": times})  # fmt: skip
    stage = ImageReading(OcrReader(a.threads))
    stage.read(data)
    start = time.perf_counter()
    again = stage.read(data)
    cached_ms = (time.perf_counter() - start) * 1000
    assert again.cached
    print("| reader | p50 (ms) | p90 (ms) | min (ms) | rows read | character error rate |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['reader']} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} | {r['min_ms']:.0f} | {r['lines_read']} | {100 * r['cer']:.1f}% |")
    print(f"the same picture again (content-hash cache): {cached_ms:.2f} ms")
    print(f"image stage p50 {rows[0]['p50_ms']:.0f} ms vs the library's defaults {rows[1]['p50_ms']:.0f} ms "
          f"({rows[1]['p50_ms'] / rows[0]['p50_ms']:.2f}x)")  # fmt: skip
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m assistant.image_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
                       f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end",
            "picture": {"size": size, "lines": len(PICTURE.rows), "png_bytes": len(data)},
            "readers": rows, "cached_ms": cached_ms,
        }, indent=2) + "\n", encoding="utf-8")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
