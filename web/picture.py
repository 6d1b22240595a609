"""Pictures from the page (an uploaded file, a pasted image or a camera shot) as the data URL a
Realtime ``input_image`` part carries.

The picture is checked and scaled by the assistant's own :func:`~assistant.image_reading.open_image`
(so the page refuses what the server would), then sent as a JPEG: a phone photo of several
megabytes becomes a few hundred kilobytes, inside one Realtime event's size limit.
"""

from __future__ import annotations

import io
from pathlib import Path

from assistant.image_reading import data_url, open_image

JPEG_QUALITY = 90


def picture_url(path: str | Path) -> str:
    """The picture at ``path`` as a JPEG data URL; raises ImageError saying what is wrong with it."""
    image = open_image(Path(path).read_bytes())
    out = io.BytesIO()
    image.save(out, "JPEG", quality=JPEG_QUALITY)
    return data_url(out.getvalue(), "image/jpeg")


__all__ = ["picture_url"]
