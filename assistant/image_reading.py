"""The image stage: the text of a user's picture (a receipt, a form, a screenshot of an error), read
so the answer can use it beside the handbook.

No vision-language model ships its weights on the package registry, but the questions employees
ask about a picture ("can I claim this?", "which field is the cost centre?") need its text. So an
image goes through three steps:

1. :func:`image_bytes` takes the image from a data URL (``data:image/png;base64,...``, as OpenAI's
   APIs send it); a remote URL is refused: the server never fetches anything.
2. :func:`open_image` checks it (size in bytes, a format Pillow can decode, at most
   :data:`MAX_PIXELS` before decoding, a complete file) and scales it to at most
   :data:`READ_SIDE` pixels a side. Every problem is an :class:`ImageError` with a code and a
   sentence for the user.
3. :class:`ImageReading` hands it to an :class:`ImageReader` (the seam: today
   :class:`OcrReader`, PP-OCRv4 through ``rapidocr-onnxruntime`` on the CPU) and keeps the
   result by the image's content hash, so an identical image is read once.

:class:`ImageText` holds the lines in reading order, boxes on one row joined left to right (a
form's label and its value stay on one line), and renders the block that enters the turn after
the documents prefix (:func:`image_prompt`). A vision encoder would be another ``ImageReader``
whose output is embeddings for the engine's prefill instead of text; docs/architecture.md says
what the engine would need for it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from PIL import Image, ImageOps
from prometheus_client import CollectorRegistry, Counter, Histogram

MAX_IMAGE_BYTES = 8 << 20  # one image's encoded bytes
MAX_PIXELS = 24_000_000  # width x height, checked before the pixels are decoded (a 50-megapixel photo is refused)
MAX_IMAGES = 4  # images in one turn or one HTTP chat
READ_SIDE = 1600  # longer sides are scaled down to this before reading (text stays legible, reading stays fast)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
NO_TEXT = "I can't read any text in that image."
CACHE_ENTRIES = 256


class ImageError(ValueError):
    """An image we cannot take: ``code`` for the API's error, the message for the user."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class TextLine:
    """One piece of text found in the image: its text, the reader's confidence, its box (x0, y0, x1, y1)."""

    text: str
    score: float
    box: tuple[float, float, float, float]


@dataclass(frozen=True)
class ImageText:
    """What was read from one image. ``read_ms`` is the reader's time (0 for a cache hit)."""

    digest: str  # sha256 of the encoded bytes
    size: tuple[int, int]  # as read (after scaling down)
    lines: tuple[TextLine, ...]
    read_ms: float
    cached: bool = False

    @property
    def rows(self) -> list[str]:
        """The text in reading order: boxes whose vertical centres fall in one row's band are
        joined left to right, ``" | "`` across a wide gap (a label and its value), else a space."""
        rows: list[list[TextLine]] = []
        for line in sorted(self.lines, key=lambda ln: (ln.box[1] + ln.box[3]) / 2):
            centre = (line.box[1] + line.box[3]) / 2
            if rows:
                top = min(ln.box[1] for ln in rows[-1])
                bottom = max(ln.box[3] for ln in rows[-1])
                if top <= centre <= bottom:
                    rows[-1].append(line)
                    continue
            rows.append([line])
        out = []
        for row in rows:
            row.sort(key=lambda ln: ln.box[0])
            text = row[0].text
            for prev, cur in zip(row, row[1:]):
                height = max(1.0, prev.box[3] - prev.box[1])
                text += (" | " if cur.box[0] - prev.box[2] > 1.5 * height else " ") + cur.text
            out.append(text)
        return out

    @property
    def text(self) -> str:
        return "\n".join(self.rows)


class ImageReader(Protocol):
    """The seam of the image stage: pixels in, text lines out. ``name`` appears in logs and metrics."""

    name: str

    def read(self, image: Image.Image) -> list[TextLine]: ...


class OcrReader:
    """PP-OCRv4 detection and recognition (Chinese and English), ONNX on the CPU, through
    ``rapidocr-onnxruntime``'s models. The models load on first use (about half a second); calls
    are serialized (one session per model, its threads given by ``threads``; 0: onnxruntime's choice).

    Detection runs on a copy scaled to at most ``det_side`` pixels a side (the library's own
    pipeline detects a 1,280 px picture at full size: its size limit only picks between 960,
    1,500 and 2,000); each found line is then cut from the full-size picture (a plain slice when
    the line is upright, as on receipts, forms and screenshots; the library's perspective crop
    otherwise) and recognized at full resolution and at its own width, so small text keeps its
    pixels and a short label is not padded to a long line's width.
    """

    name = "rapidocr-ppocrv4"

    def __init__(self, threads: int = 0, min_score: float = 0.5, det_side: int = 736) -> None:
        self.threads = threads
        self.min_score = min_score
        self.det_side = det_side
        self._ocr: object | None = None
        self._lock = threading.Lock()

    def _load(self) -> object:
        from rapidocr_onnxruntime import RapidOCR  # heavy (onnxruntime sessions): only when first needed

        threads = {f"{part}_intra_op_num_threads": self.threads or -1 for part in ("det", "cls", "rec")}
        # Upright pictures: no angle classifier. Lines are recognized one a call (_recognize): a
        # batch pads every line to its widest (a form's short labels beside its long title), which
        # cost more than the calls it saves (28 lines on the 2-core CPU: 478 ms one by one, 631 in
        # sixes, 832 in twelves).
        return RapidOCR(use_cls=False, text_score=self.min_score, **threads)

    def read(self, image: Image.Image) -> list[TextLine]:
        with self._lock:
            if self._ocr is None:
                self._ocr = self._load()
            ocr = self._ocr
            picture = bgr(image)
            scale = min(1.0, self.det_side / max(picture.shape[:2]))
            small = picture if scale == 1.0 else np.asarray(image.convert("RGB").resize(
                (max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.Resampling.BILINEAR))[:, :, ::-1]
            boxes, _ = ocr.text_det(np.ascontiguousarray(small))  # type: ignore[attr-defined]
            if boxes is None or len(boxes) == 0:
                return []
            boxes = [np.asarray(box, np.float32) / scale for box in ocr.sorted_boxes(boxes)]  # type: ignore[attr-defined]
            recognized = [_recognize(ocr.text_rec, _crop(ocr, picture, box)) for box in boxes]  # type: ignore[attr-defined]
        return text_lines(boxes, recognized, self.min_score)


def bgr(image: Image.Image) -> np.ndarray:
    """The picture as OpenCV's BGR pixels, which the OCR models take."""
    return np.ascontiguousarray(np.asarray(image.convert("RGB"))[:, :, ::-1])


def text_lines(boxes: Sequence, recognized: Sequence[tuple[str, float]], min_score: float) -> list[TextLine]:
    """The recognized lines with text and a score of at least ``min_score``, each with its box's bounds."""
    lines = []
    for box, (text, score) in zip(boxes, recognized):
        if text.strip() and float(score) >= min_score:
            xs, ys = np.asarray(box, np.float32)[:, 0], np.asarray(box, np.float32)[:, 1]
            lines.append(TextLine(text.strip(), float(score), (float(xs.min()), float(ys.min()), float(xs.max()), float(ys.max()))))
    return lines


def _recognize(rec: object, line: np.ndarray) -> tuple[str, float]:
    """One line's text and score, the line scaled to the recognizer's height at its own width.

    The library pads every line to at least 320 px wide (its batches' shape); a form's short
    labels ("Taxi", "4") are mostly padding then. Read at their own width (the library's own
    resize and normalization, given the line's width-to-height ratio as the batch's), the 28 lines
    of the image bench's picture took 365 ms instead of 550 on the 2-core CPU, every character the same."""
    h, w = line.shape[:2]
    x = rec.resize_norm_img(line, w / h)  # type: ignore[attr-defined]
    preds = rec.session(x[None])[0]  # type: ignore[attr-defined]
    text, score = rec.postprocess_op(preds)[0][:2]  # type: ignore[attr-defined]
    return text, float(score)


def _crop(ocr: object, picture: np.ndarray, box: np.ndarray) -> np.ndarray:
    """The line's pixels: a slice when the box is an upright rectangle (within a pixel), else the
    library's perspective crop."""
    (x0, y0), (x1, y1), (x2, y2), (x3, y3) = box
    if max(abs(y0 - y1), abs(y3 - y2), abs(x0 - x3), abs(x1 - x2)) <= 1.0:
        h, w = picture.shape[:2]
        top, bottom = max(0, int(min(y0, y1))), min(h, int(np.ceil(max(y2, y3))))
        left, right = max(0, int(min(x0, x3))), min(w, int(np.ceil(max(x1, x2))))
        if bottom > top and right > left:
            return picture[top:bottom, left:right]
    return ocr.get_crop_img_list(picture, [box])[0]  # type: ignore[attr-defined]


def image_bytes(url: str) -> bytes:
    """The encoded image of a ``data:`` URL; a remote URL or anything else raises :class:`ImageError`."""
    head, _, payload = url.partition(",")
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme in ("http", "https", "ftp", "file"):
        raise ImageError("remote_image_url", "images are taken as data URLs only (data:image/png;base64,...); "
                         "this server never fetches a URL")  # fmt: skip
    if scheme != "data" or not payload:
        raise ImageError("invalid_image_url", "an image must be a data URL: data:image/png;base64,...")
    if not head.lower().startswith("data:image/") or not head.lower().endswith(";base64"):
        raise ImageError("invalid_image_url", "the data URL must be a base64 image (data:image/...;base64,...)")
    if len(payload) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise ImageError("image_too_large", f"the image is over {MAX_IMAGE_BYTES >> 20} MB")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError("invalid_image", f"the image's data is not valid base64: {exc}") from exc


def data_url(data: bytes, mime: str = "image/png") -> str:
    """``data:<mime>;base64,...`` of encoded image bytes (the shape the APIs take)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def open_image(data: bytes) -> Image.Image:
    """Decode and check an encoded image; the result is RGB, upright (EXIF) and at most
    :data:`READ_SIDE` a side. Raises :class:`ImageError` saying what is wrong."""
    if not data:
        raise ImageError("invalid_image", "the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError("image_too_large", f"the image is {len(data) / (1 << 20):.1f} MB; the limit is {MAX_IMAGE_BYTES >> 20} MB")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise ImageError("unsupported_image_format", f"{image.format} images are not supported ({', '.join(FORMATS)})")
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise ImageError("image_too_large", f"the image is {width}x{height} ({width * height / 1e6:.0f} megapixels); "
                                 f"the limit is {MAX_PIXELS / 1e6:.0f} megapixels")  # fmt: skip
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError("image_too_large", f"the image is too large to decode: {exc}") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow: not an image, truncated or corrupt
        raise ImageError("invalid_image", f"this is not an image that can be read (PNG, JPEG, WebP, GIF, BMP): {exc}") from exc
    image = ImageOps.exif_transpose(image).convert("RGB")
    if max(image.size) > READ_SIDE:
        image.thumbnail((READ_SIDE, READ_SIDE), Image.Resampling.LANCZOS)
    return image


class ImageReading:
    """The image stage every session shares: a reader behind a content-hash cache, with metrics.

    :meth:`read` is blocking (run it in a worker thread); identical bytes are read once (the
    last :data:`CACHE_ENTRIES` images are kept)."""

    def __init__(self, reader: ImageReader | None = None, cache_entries: int = CACHE_ENTRIES) -> None:
        self.reader: ImageReader = reader or OcrReader()
        self.cache_entries = cache_entries
        self._cache: OrderedDict[str, ImageText] = OrderedDict()
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self._seconds = Histogram(
            "assistant_image_read_seconds", "Time the image reader took for one image (cache hits not counted).",
            ("reader",), buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0), registry=self.registry,
        )  # fmt: skip
        self._images = Counter(
            "assistant_images", "Images taken by outcome: read, cached (an identical image was read before), "
            "no_text, refused (not an image, too large, a remote URL, ...).", ("outcome",), registry=self.registry,
        )  # fmt: skip

    def image_bytes(self, url: str) -> bytes:
        """:func:`image_bytes` of ``url``, counting a refused one before its ImageError goes on."""
        try:
            return image_bytes(url)
        except ImageError:
            self._images.labels("refused").inc()
            raise

    def check(self, data: bytes) -> None:
        """Raise :class:`ImageError` now for bytes :meth:`read` would refuse (blocking: decodes
        them), so a bad image is refused when it arrives, not when the answer needs it."""
        with self._lock:
            if hashlib.sha256(data).hexdigest() in self._cache:
                return
        try:
            open_image(data)
        except ImageError:
            self._images.labels("refused").inc()
            raise

    def read(self, data: bytes) -> ImageText:
        """The text of an encoded image; raises :class:`ImageError` for one that cannot be read."""
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
        if hit is not None:
            self._images.labels("cached").inc()
            return ImageText(hit.digest, hit.size, hit.lines, 0.0, cached=True)
        try:
            image = open_image(data)
        except ImageError:
            self._images.labels("refused").inc()
            raise
        start = time.perf_counter()
        lines = tuple(self.reader.read(image))
        seconds = time.perf_counter() - start
        self._seconds.labels(self.reader.name).observe(seconds)
        self._images.labels("read" if lines else "no_text").inc()
        text = ImageText(digest, image.size, lines, round(seconds * 1000, 3))
        with self._lock:
            self._cache[digest] = text
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return text


def image_prompt(texts: Sequence[ImageText], question: str) -> str:
    """The user's turn with the text of their images in front of the question, marked as theirs
    (so the answer can say "the receipt shows ..." and then what the handbook says)."""
    blocks = []
    for i, text in enumerate(texts, 1):
        which = f" {i} of {len(texts)}" if len(texts) > 1 else ""
        body = text.text if text.lines else "(no text could be read)"
        blocks.append(f'Text read from the picture{which} the user sent:\n"""\n{body}\n"""')
    return "\n\n".join([*blocks, question.strip() or "What does this picture say, and what does the handbook say about it?"])


PICTURE_BLOCK = re.compile(r'Text read from the picture[^\n]*the user sent:\n"""\n(.*?)\n"""', re.DOTALL)


def picture_texts(content: str) -> list[str]:
    """The picture texts :func:`image_prompt` put in a user message, in order."""
    return PICTURE_BLOCK.findall(content)


def check_count(count: int) -> None:
    """Raise :class:`ImageError` for more than :data:`MAX_IMAGES` images in one turn."""
    if count > MAX_IMAGES:
        raise ImageError("too_many_images", f"{count} images in one turn; the limit is {MAX_IMAGES}")


__all__ = [
    "FORMATS", "MAX_IMAGES", "MAX_IMAGE_BYTES", "MAX_PIXELS", "NO_TEXT", "READ_SIDE", "ImageError", "ImageReader",
    "ImageReading", "ImageText", "OcrReader", "TextLine", "check_count", "data_url", "image_bytes", "image_prompt",
    "open_image", "picture_texts",
]  # fmt: skip
