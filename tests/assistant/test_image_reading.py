"""The image stage on real rendered pictures: what it reads, its cache, and every bad input."""

from __future__ import annotations

import io

import numpy as np

import pytest
from PIL import Image

from assistant.eval_images import PICTURES, character_error_rate, render
from assistant.image_reading import (
    MAX_IMAGES, ImageError, ImageText, TextLine, check_count, data_url, image_bytes, image_prompt, open_image,
)  # fmt: skip


def _picture(name: str):
    return next(p for p in PICTURES if p.name == name)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("name", ["hotel-receipt-manchester", "travel-form-zh"])
def test_reads_a_rendered_picture_with_its_layout(image_reading, name):
    picture = _picture(name)
    text = image_reading.read(render(picture))
    assert character_error_rate(picture.reference, text.text) < 0.03, text.text
    # A label and its value are far apart in the picture but stay on one row.
    label, value = next(row for row in picture.rows if len(row) == 2)
    assert any(row.startswith(label.replace(" ", "")[:2]) and value.replace(" ", "") in row.replace(" ", "")
               for row in text.rows), text.rows  # fmt: skip
    assert not text.cached and text.read_ms > 0


def test_identical_images_are_read_once(image_reading):
    data = render(_picture("password-expired"))
    first = image_reading.read(data)
    again = image_reading.read(bytes(data))
    assert again.cached and again.read_ms == 0.0 and again.lines == first.lines and again.digest == first.digest
    samples = {s.name + str(s.labels): s.value for m in image_reading.registry.collect() for s in m.samples}
    assert samples["assistant_images_total{'outcome': 'cached'}"] >= 1


def test_an_image_without_text_reads_no_lines(image_reading):
    text = image_reading.read(_png(Image.new("RGB", (800, 600), "#dde6ee")))
    assert text.lines == ()
    assert "no text could be read" in image_prompt([text], "What is this?")


@pytest.mark.parametrize("data, code", [
    (b"hello, not an image", "invalid_image"),
    (b"", "invalid_image"),
    (render(PICTURES[0])[:4000], "invalid_image"),  # a truncated PNG
    (_png(Image.new("L", (10_000, 5_000))), "image_too_large"),  # 50 megapixels
    (b"\x00" * (9 << 20), "image_too_large"),
])  # fmt: skip
def test_bad_images_are_refused_with_a_reason(image_reading, data, code):
    with pytest.raises(ImageError) as info:
        image_reading.read(data)
    assert info.value.code == code and str(info.value)


def test_tiff_is_not_taken():
    out = io.BytesIO()
    Image.new("RGB", (20, 20)).save(out, "TIFF")
    with pytest.raises(ImageError, match="TIFF") as info:
        open_image(out.getvalue())
    assert info.value.code == "unsupported_image_format"


@pytest.mark.parametrize("url, code", [
    ("https://example.com/receipt.png", "remote_image_url"),
    ("http://10.0.0.1/x.jpg", "remote_image_url"),
    ("file:///etc/passwd", "remote_image_url"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image_url"),
    ("data:image/png;base64,@@@", "invalid_image"),
    ("receipt.png", "invalid_image_url"),
])  # fmt: skip
def test_only_data_urls_are_taken(url, code):
    with pytest.raises(ImageError) as info:
        image_bytes(url)
    assert info.value.code == code


def test_data_url_round_trip_and_scaling():
    data = _png(Image.new("RGB", (4000, 1000), "white"))
    assert image_bytes(data_url(data)) == data
    assert open_image(data).size == (1600, 400)


def test_more_images_than_the_limit_are_refused():
    check_count(MAX_IMAGES)
    with pytest.raises(ImageError) as info:
        check_count(MAX_IMAGES + 1)
    assert info.value.code == "too_many_images"


def test_rows_join_boxes_in_reading_order():
    lines = (
        TextLine("GBP 187.40", 0.99, (700, 102, 900, 130)),
        TextLine("Total", 0.99, (100, 100, 180, 128)),
        TextLine("Receipt", 0.99, (100, 20, 260, 50)),
        TextLine("no. 5", 0.99, (270, 22, 340, 50)),
    )
    text = ImageText("d", (1000, 200), lines, 1.0)
    assert text.rows == ["Receipt no. 5", "Total | GBP 187.40"]
    prompt = image_prompt([text], "Can I claim this?")
    assert prompt.index("Total | GBP 187.40") < prompt.index("Can I claim this?")


def test_detection_on_a_scaled_copy_reads_as_full_size_detection():
    """OcrReader finds lines on a copy scaled to ``det_side`` and recognizes them from the full
    picture: the same lines as detecting at full size (their text within a space or so), boxes in
    the full picture's coordinates."""

    from assistant.image_reading import OcrReader, _crop

    picture = _picture("hotel-receipt-manchester")
    image = open_image(render(picture))
    full = OcrReader(det_side=max(image.size)).read(image)  # no scaling
    scaled = OcrReader(det_side=max(image.size) // 2).read(image)
    assert len(scaled) == len(full)
    joined = "\n".join(line.text for line in scaled)
    assert character_error_rate("\n".join(line.text for line in full), joined) < 0.01
    assert character_error_rate(picture.reference, ImageText("", image.size, tuple(scaled), 1.0).text) < 0.03
    for a, b in zip(scaled, full):
        assert max(abs(p - q) for p, q in zip(a.box, b.box)) < 8  # pixels of the full picture
    pixels = np.arange(40 * 60 * 3, dtype=np.uint8).reshape(40, 60, 3)
    upright = np.array([[10.2, 5.0], [50.0, 5.4], [50.0, 30.0], [10.0, 30.0]], np.float32)
    np.testing.assert_array_equal(_crop(None, pixels, upright), pixels[5:30, 10:50])  # a slice, no resampling
    reader = OcrReader()
    reader.read(image)  # loads the models
    tilted = np.array([[10, 5], [50, 12], [48, 30], [8, 24]], np.float32)
    assert _crop(reader._ocr, pixels, tilted).shape[:2] == (19, 40)  # the library's perspective crop


def test_each_line_is_recognized_at_its_own_width_and_reads_as_the_librarys_padded_batch():
    """The recognizer gets each line scaled to its height at the line's own width (the library
    pads every line to at least 320 px): short labels are narrow inputs, and every line's text is
    what the library's own padded recognition reads. The real model runs; a wrapper around its
    session only records the input widths."""
    from assistant.image_reading import OcrReader, _crop, bgr

    image = open_image(render(_picture("expense-claim-form")))
    reader = OcrReader()
    lines = reader.read(image)  # loads the models
    rec, shapes = reader._ocr.text_rec, []
    session = rec.session

    class Recording:
        def __call__(self, x):
            shapes.append(x.shape)
            return session(x)

    rec.session = Recording()
    try:
        again = reader.read(image)
    finally:
        rec.session = session
    assert [line.text for line in again] == [line.text for line in lines]
    assert len(shapes) == len(lines) and all(s[0] == 1 and s[2] == 48 for s in shapes)  # one line a call, 48 px high (PP-OCRv4)
    assert min(s[3] for s in shapes) < 160 < 320 <= max(s[3] for s in shapes)  # short labels are narrow inputs
    picture = bgr(image)
    boxes = [np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.float32) for x0, y0, x1, y1 in (line.box for line in lines)]
    padded, _ = rec([_crop(reader._ocr, picture, box) for box in boxes])  # the library's batches, padded
    assert [text.strip() for text, _ in padded] == [line.text for line in lines]
