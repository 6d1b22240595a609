"""Tokenizer front end: HF fast tokenizers, chat templates, and GGUF-embedded vocabularies.

A GGUF file carries its tokenizer as metadata; transformers converts it (several seconds), so
the converted tokenizer is cached under the engine's cache directory, keyed by the file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engine.config import default_cache_dir

log = logging.getLogger(__name__)


class Tokenizer:
    """Wraps a HF fast tokenizer; exposes the raw ``tokenizers.Tokenizer`` for streaming decode."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer

    @classmethod
    def load(cls, path: str | Path, cache_dir: Path | None = None) -> "Tokenizer":
        """From a HF directory, or from a ``.gguf`` file (converted once, then cached)."""
        from transformers import AutoTokenizer

        path = Path(path)
        if path.suffix == ".gguf":
            stat = path.stat()
            cached = (cache_dir or default_cache_dir()) / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
            if not (cached / "tokenizer.json").is_file():
                log.info("converting the tokenizer embedded in %s (once)", path.name)
                hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                cached.mkdir(parents=True, exist_ok=True)
                hf.save_pretrained(str(cached))
            path = cached
        return cls(AutoTokenizer.from_pretrained(str(path)))

    def pad_vocab(self, size: int) -> None:
        """Add placeholder tokens up to ``size`` ids (for random weights whose vocabulary is larger
        than the tokenizer lent to them): ``" ~"`` and the id in letters (``" ~ab"``), short enough
        for a voice to say quickly; ordinary text (no ``~``) encodes as before."""
        self.hf.add_tokens([f" ~{_letters(i)}" for i in range(len(self.hf), size)])

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (with the tokenizer's own special-token policy)."""
        return list(self.hf(text)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, through the model's own jinja chat template."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])


def _letters(n: int) -> str:
    """``n`` in base 26, written with the letters a-z."""
    out = ""
    while True:
        n, r = divmod(n, 26)
        out = chr(97 + r) + out
        if n == 0:
            return out
