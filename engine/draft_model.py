"""Drafts from a smaller model: the draft model decodes a few tokens ahead of each request, greedily,
and the target verifies them in one step (engine/speculative.py).

The draft model runs as an engine of its own (its own weights, KV cache, block manager and model
runner on the same device), but not through its own scheduler: this proposer steps it directly.
Each target request that drafts has a *mirror* in the draft engine, a request that holds the same
tokens and the draft model's KV for them, so a proposal costs only the new tokens, not the prompt:

1. **Sync.** The mirror's tokens are the request's verified tokens, then the drafts it proposed
   last time. The target accepted some of those drafts and appended one token of its own; the
   mirror is cut back to the tokens both share (its KV past them is simply computed over) and
   takes the target's new ones. A new mirror starts with the prompt, whose full blocks the draft
   engine's prefix cache may hold already (the handbook in front of every question).
2. **Draft.** ``k`` rounds, one draft-engine step each, over every mirror still owed drafts: the
   first round computes each mirror's new tokens (one or two; a new mirror's prompt, in chunks of
   the draft engine's step budget, before the rounds), every round appends the draft model's
   greedy token. A greedy draft is a single proposed token, so verifying it by sampling stays
   exact at any temperature (engine/speculative.py). The rounds are not waited for one by one:
   each round's input tokens are the previous round's greedy tokens still on the device (the
   runner's pending tokens, as with async scheduling), so the host prepares round ``r + 1``
   while the device runs round ``r`` and reads every round's tokens back with one wait at the
   end. On the H200 a 0.5B draft step took 1.1 ms with the host's work when each round was
   waited for, 1.0 ms launched back to back (docs/performance.md).

Only verified tokens are ever registered in the draft engine's prefix cache (the mirror's full
blocks are registered at sync time, before any drafts are appended): a block whose content a
rejected draft later changes is never findable by its old hash. A mirror that cannot get KV blocks
(the draft cache is full), or would pass the draft's context, proposes nothing and is dropped; its
request goes on without drafts. A finished request's mirror is released (its blocks freed, their
verified content kept in the prefix cache).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.engine_core import EngineCore
from engine.model_runner import DeviceTokens
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.speculative import DraftWant

log = logging.getLogger(__name__)


@dataclass
class DraftTimes:
    """Where a draft model's proposals spent their time: draft-engine steps and their seconds."""

    steps: int = 0
    seconds: float = 0.0


class DraftModelProposer:
    """Proposes each request's next tokens as the draft engine ``draft`` decodes them greedily."""

    def __init__(self, draft: EngineCore) -> None:
        self.draft = draft
        self.mirrors: dict[str, Request] = {}
        self.times = DraftTimes()
        self._greedy = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)

    # ---- the proposer interface -------------------------------------------------------------------
    def propose_batch(self, wants: list[DraftWant]) -> list[list[int]]:
        """Up to ``want.k`` greedy draft tokens for each want (none where the draft engine has no
        room for it)."""
        start = time.perf_counter()
        owed = {w.request_id: w.k for w in wants}
        live: list[Request] = []
        for want in wants:
            mirror = self._sync(want)
            if mirror is not None:
                live.append(mirror)
        live = self._catch_up(live)
        drafting = list(live)
        rounds: list[DeviceTokens] = []  # each round's greedy tokens, on the device
        for r in range(max((owed[m.request_id] for m in live), default=0)):
            # a mirror short of KV blocks is gone (dropped in _launch): its drafts so far still stand
            live = [m for m in live if m.request_id in self.mirrors and owed[m.request_id] > r]
            if not live:
                break
            launched = self._launch(live, rounds[-1] if rounds else None)
            if launched is None:
                break
            rounds.append(launched)
        drafts: dict[str, list[int]] = {w.request_id: [] for w in wants}
        if rounds:
            host = torch.cat([t.tokens for t in rounds]).tolist()  # the one wait for the device
            offset = 0
            for t in rounds:
                for request_id, row in t.row_of.items():
                    drafts[request_id].append(host[offset + row])
                offset += len(t.tokens)
        for mirror in drafting:
            mirror.num_pending_tokens = 0
            for token in drafts[mirror.request_id]:
                mirror.append_output(token)
        self.times.seconds += time.perf_counter() - start
        return [drafts[w.request_id] for w in wants]

    @property
    def drafts_ahead(self) -> bool:
        """No: a guess of the token in flight would cost one more draft step (1.0 ms for the 0.5B
        on the H200) where reading that step back costs the host's work of one step."""
        return False

    def release(self, request_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """Free the mirror's KV blocks (their verified full blocks stay in the draft's prefix cache);
        the output is not needed: the draft model's prefix cache keeps what it computed."""
        mirror = self.mirrors.pop(request_id, None)
        if mirror is not None:
            self.draft.block_manager.free(mirror)
            mirror.status = RequestStatus.FINISHED_ABORTED

    # ---- mirrors ------------------------------------------------------------------------------------
    def _sync(self, want: DraftWant) -> Request | None:
        """The request's mirror holding exactly its verified tokens, with the KV of as many of them
        as it had computed; None when the draft's context has no room for the drafts."""
        tokens = want.token_ids
        if len(tokens) + want.k > self.draft.max_model_len:
            self.release(want.request_id)
            return None
        mirror = self.mirrors.get(want.request_id)
        if mirror is None:
            mirror = Request(want.request_id, list(tokens), self._greedy)
            mirror.status = RequestStatus.RUNNING
            cached = self.draft.block_manager.find_cached_prefix(mirror)
            if not self.draft.block_manager.allocate_slots(mirror, 0, cached):
                return None
            mirror.num_computed_tokens = len(cached) * self.draft.config.block_size
            self.mirrors[want.request_id] = mirror
            return mirror
        have = mirror.all_token_ids
        same = 0
        limit = min(len(have), len(tokens))
        while same < limit and have[same] == tokens[same]:
            same += 1
        if same < mirror.num_prompt_tokens:  # not this request's history (cannot happen for one request): start over
            self.release(want.request_id)
            return self._sync(want)
        del mirror.output_token_ids[same - mirror.num_prompt_tokens :]
        del mirror.all_token_ids[same:]
        for token in tokens[same:]:
            mirror.append_output(token)
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, same)
        self.draft.block_manager.cache_full_blocks(mirror)  # verified tokens only (module docstring)
        return mirror

    def _catch_up(self, mirrors: list[Request]) -> list[Request]:
        """Compute all but the last few tokens of mirrors far behind (a new request's prompt), in
        steps of at most the draft engine's token budget, so that each round's step is small."""
        budget = self.draft.config.max_num_batched_tokens
        behind = [m for m in mirrors if m.num_tokens - m.num_computed_tokens > 1 + budget // 8]
        for mirror in behind:
            while mirror.request_id in self.mirrors and mirror.num_tokens - mirror.num_computed_tokens > 1:
                n = min(budget, mirror.num_tokens - mirror.num_computed_tokens - 1)
                if not self._compute(mirror, n):
                    break
        return [m for m in mirrors if m.request_id in self.mirrors]

    def _compute(self, mirror: Request, n: int) -> bool:
        """One draft step computing ``n`` of the mirror's tokens without sampling (a prompt chunk)."""
        if not self.draft.block_manager.allocate_slots(mirror, n):
            self._drop(mirror)
            return False
        inputs = self.draft.runner.prepare([ScheduledChunk(mirror, n)])
        self.draft.runner.execute(inputs)
        mirror.num_computed_tokens += n
        self.times.steps += 1
        return True

    def _launch(self, mirrors: list[Request], pending: DeviceTokens | None) -> DeviceTokens | None:
        """Launch one draft step, not waiting for it: each mirror computes its uncomputed tokens,
        the last of them the previous round's greedy token still on the device (``pending``);
        returns this round's greedy tokens on the device (None when no mirror got KV blocks)."""
        chunks = []
        for mirror in mirrors:
            n = mirror.num_tokens - mirror.num_computed_tokens
            if self.draft.block_manager.allocate_slots(mirror, n):
                chunks.append(ScheduledChunk(mirror, n))
            else:
                self._drop(mirror)
        if not chunks:
            return None
        inputs = self.draft.runner.prepare(chunks, pending)
        out = self.draft.runner.execute(inputs)
        greedy = out.argmax if out.argmax is not None else torch.argmax(out.logits, dim=-1)
        # a decode graph's argmax is its persistent buffer, which the next replay overwrites
        launched = DeviceTokens(greedy.clone(), {c.request.request_id: i for i, c in enumerate(inputs.sampled_chunks)})
        for c in chunks:
            c.request.num_computed_tokens += c.num_tokens
            c.request.num_pending_tokens += 1  # its greedy token: known on the device only, until the rounds end
        self.times.steps += 1
        return launched

    def _drop(self, mirror: Request) -> None:
        log.debug("draft KV cache full: request %s goes on without drafts", mirror.request_id)
        self.release(mirror.request_id)
