"""The shared prompt prefix (system prompt + documents) and per-conversation prompts.

The prefix is tokenized once and its token ids are reused verbatim at the start of every
prompt, so the engine's prefix cache computes its KV once for all sessions. The conversation
that follows is rendered with the model's own chat template and tokenized separately; the
template's end-of-turn special token after the system message keeps the boundary clean.
"""

from __future__ import annotations

from dataclasses import dataclass

from assistant.docs import DocumentSet

Message = dict[str, str]


@dataclass(frozen=True)
class PromptPrefix:
    system_text: str
    token_ids: tuple[int, ...]
    rendered: str
    docs_version: str


class PromptBuilder:
    """Builds token ids of ``prefix + history + question`` for one tokenizer."""

    def __init__(self, tokenizer, system_prompt: str, docs: DocumentSet) -> None:
        self.tokenizer = tokenizer
        system_text = f"{system_prompt}\n\n{docs.render()}"
        rendered = tokenizer.render_chat([{"role": "system", "content": system_text}], add_generation_prompt=False)
        self.prefix = PromptPrefix(system_text, tuple(tokenizer.hf(rendered, add_special_tokens=False)["input_ids"]), rendered, docs.version)

    def build(self, history: list[Message], question: str) -> list[int]:
        """Token ids for the next answer: the cached prefix, earlier turns, then the question."""
        messages = [{"role": "system", "content": self.prefix.system_text}, *history, {"role": "user", "content": question}]
        full = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        if not full.startswith(self.prefix.rendered):
            raise ValueError("the chat template does not render the system message as a stable prefix")
        rest = full[len(self.prefix.rendered) :]
        return list(self.prefix.token_ids) + list(self.tokenizer.hf(rest, add_special_tokens=False)["input_ids"])
