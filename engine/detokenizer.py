"""Streaming detokenization with stop strings.

Text is produced token by token with ``tokenizers``' ``DecodeStream``, which holds back bytes
until they form whole UTF-8 characters, so a delta never carries half a Chinese character or
emoji. Stop strings are matched on the accumulated text (so one split across tokens is found);
while stop strings are set, the last ``len(longest stop) - 1`` characters are held back from
the stream until it is clear they do not begin a stop string.
"""

from __future__ import annotations

from tokenizers import Tokenizer as RawTokenizer
from tokenizers.decoders import DecodeStream

from engine.sampling import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: RawTokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stops = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of ``text`` already handed out
        self.searched = 0  # characters of ``text`` already searched for stop strings

    def add_token(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed, if any (text is then cut)."""
        piece = self.stream.step(self.tokenizer, token_id)
        if piece:
            self.text += piece
        if not self.stops:
            return None
        start = max(0, self.searched - self.hold)
        found: tuple[int, str] | None = None
        for stop in self.stops:
            i = self.text.find(stop, start)
            if i >= 0 and (found is None or i < found[0]):
                found = (i, stop)
        self.searched = len(self.text)
        if found is None:
            return None
        i, stop = found
        self.text = self.text[: i + len(stop)] if self.include_stop else self.text[:i]
        return stop

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; held-back characters are released once finished."""
        upto = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta
