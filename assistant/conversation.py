"""One session's conversation: its turns, rendered as chat messages after the shared prefix.

Earlier turns go into the prompt verbatim, so each new prompt starts with the previous one and
the engine's prefix cache reuses their KV too. When the context budget runs out, whole turns are
dropped, oldest first (``oldest_first_cuts``); the documents prefix is never cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

Message = dict[str, str]  # {"role": "user" | "assistant" | "system", "content": ...}


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str
    # The user message as the model saw it (the question with the handbook document repeated in
    # front of it and the answer's form); None: the question itself. Later prompts render it
    # verbatim, so their tokens start with the ones this turn computed and the prefix cache has
    # them, answer included (a follow-up prefills only its own message).
    content: str | None = None


@dataclass
class Conversation:
    """The turns of one session, oldest first."""

    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[Message]:
        """The turns as alternating user/assistant chat messages."""
        return [m for t in self.turns
                for m in ({"role": "user", "content": t.content or t.question}, {"role": "assistant", "content": t.answer})]  # fmt: skip

    def add(self, question: str, answer: str, content: str | None = None) -> None:
        self.turns.append(Turn(question, answer, content))

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest turns (they no longer fit the context, and never will again)."""
        del self.turns[:count]


def group_turns(history: list[Message]) -> list[list[Message]]:
    """Messages grouped into turns: each starts at a user message (anything before the first is one turn)."""
    turns: list[list[Message]] = []
    for message in history:
        if message["role"] == "user" or not turns:
            turns.append([])
        turns[-1].append(message)
    return turns


def oldest_first_cuts(history: list[Message]) -> Iterator[tuple[list[Message], int]]:
    """``(kept messages, dropped turns)``: the whole history, then without its oldest turn, ... then none."""
    turns = group_turns(history)
    for dropped in range(len(turns) + 1):
        yield [m for turn in turns[dropped:] for m in turn], dropped
