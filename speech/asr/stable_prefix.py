"""Local agreement over the decodes of a growing utterance: the part of a partial that stays."""

from __future__ import annotations

import re

_UNIT = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]|[^\s\u3400-\u9fff\uf900-\ufaff]+")


class StablePrefix:
    """Local agreement over decodes of a growing utterance.

    A unit (a word, or one CJK character) becomes stable once two decodes in a row agree on it;
    the newest decode's last unit is always held back (its audio may be cut mid-word).
    """

    def __init__(self) -> None:
        self.text = ""
        self._previous: list[str] | None = None

    def update(self, hypothesis: str) -> bool:
        """Take a new decode (which starts with the stable text); True if the stable text grew."""
        if not hypothesis.startswith(self.text):
            self._previous = None
            return False
        matches = list(_UNIT.finditer(hypothesis))
        units = [m.group() for m in matches]
        previous, self._previous = self._previous, units
        if previous is None:
            return False
        agreed = 0
        for a, b in zip(previous, units[:-1]):
            if a != b:
                break
            agreed += 1
        stable = hypothesis[: matches[agreed - 1].end()] if agreed else ""
        if len(stable) > len(self.text):
            self.text = stable
            return True
        return False


__all__ = ["StablePrefix"]
