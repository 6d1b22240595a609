"""One-off (2026-12-06): the speculative bench with n-gram drafting as it was before drafts went
ahead of the step in flight: with async scheduling the step in flight was read back first whenever
the tokens known so far ended in an n-gram seen before, and the drafts were proposed on the full
tokens; otherwise the step stayed async without drafts. To set beside a run of today's code on the
same machine.
Run from the repository root on a GPU: ``PYTHONPATH=$PWD python engine/bench/experiments/spec_read_back_when_likely.py
--model QWEN1.5B.gguf --documents assistant/handbook/en/*.md --questions docs/results/2026-12-04-spec-questions-en32.txt
--batch 1 2 8 32 --max-tokens 64 --row-cost 0.05`` (any ``engine.bench speculative`` arguments).
"""
import sys

from engine.bench.speculative import main
from engine.engine_core import EngineCore


def propose_after_read_back(self: EngineCore) -> list:
    """The rule of 2026-12-04 (engine_core ``_propose_drafts`` then)."""
    outputs = []
    wants, resting = self._draft_wants()
    if wants and self._inflight is not None:
        if any(self.proposer.propose(w.token_ids, 1, self.proposer._index(w)) for _, w in wants):
            outputs = self._finalize(self._take_inflight())
            wants, resting = self._draft_wants()
        else:
            wants = []
    for req in resting:
        req.acceptance.rest()
    for (req, _), drafts in zip(wants, self.proposer.propose_batch([w for _, w in wants])):
        req.draft_token_ids = drafts
    return outputs


EngineCore._propose_drafts = propose_after_read_back
sys.exit(main(sys.argv[1:]))
