"""The batched greedy loop's bookkeeping, on a small random-weight Whisper on the CPU.

What the CUDA graph path adds cannot run here: rows padded up to a batch-size bucket (dead from
the start) and the replayed step, which is this same step function. Padding is forced here on
the eager path; every row must come out as when decoded without it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from speech.asr.greedy_decode import DecodeRules, GreedyDecoder, RowPrompt
from speech.asr.whisper_model import TURBO_DIMS, random_whisper
from tests.speech.test_torch_whisper import one_torch_thread  # noqa: F401 (an autouse fixture)

DIMS = replace(TURBO_DIMS, n_mels=80, n_audio_state=64, n_audio_head=2, n_audio_layer=1, n_vocab=51865,
               n_text_state=64, n_text_head=2, n_text_layer=2)  # fmt: skip
SOT, EOT, TRANSCRIBE, NO_TIMESTAMPS, NO_SPEECH = 50258, 50257, 50359, 50363, 50362
LANGUAGES = [50259, 50260, 50261, 50262]


def decoder(max_batch: int, max_new: int = 6) -> GreedyDecoder:
    torch.manual_seed(0)
    model = random_whisper(DIMS, torch.device("cpu"), torch.float32, seed=1)
    rules = DecodeRules(eot=EOT, no_speech=NO_SPEECH, lang_ids=LANGUAGES, suppress=[TRANSCRIBE, SOT],
                        suppress_begin=[220], prompt_length=4, max_new=max_new, allow_eot=False)  # fmt: skip
    return GreedyDecoder(model, rules, max_batch, cuda_graphs=False)


def audio(rows: int, scale: float = 1.0) -> torch.Tensor:
    """Random encoder output; a large ``scale`` makes it outweigh the random decoder's own bias."""
    return scale * torch.randn(rows, DIMS.n_audio_ctx, DIMS.n_audio_state, generator=torch.Generator().manual_seed(2))


def prompt(language: int | None, prefix: list[int] = (), leader: int | None = None) -> RowPrompt:
    return RowPrompt([SOT, language or SOT, TRANSCRIBE, NO_TIMESTAMPS, *prefix], language is None, leader)


def test_rows_padded_to_a_bucket_decode_as_without_padding() -> None:
    plain, padded = decoder(8), decoder(8)
    padded._bucket = lambda count: 8  # what the CUDA graph path does: 3 rows in the bucket of 8
    prompts = [prompt(LANGUAGES[1]), prompt(None, [400, 401]), prompt(LANGUAGES[0], [402])]
    features = audio(3)
    expected = plain.decode(features, prompts)
    got = padded.decode(features, prompts)
    # the same tokens and languages; the float sums may differ in the last digits (a batch of 8
    # rows can take another matmul reduction order than a batch of 3: seen on a loaded CPU)
    assert [(r.tokens, r.language_token) for r in got] == [(r.tokens, r.language_token) for r in expected]
    for row, want in zip(got, expected):
        assert row.sum_logprob == pytest.approx(want.sum_logprob, rel=1e-5)
        assert row.no_speech_prob == pytest.approx(want.no_speech_prob, rel=1e-4, abs=1e-7)
    assert [len(row.tokens) for row in expected] == [6, 2 + 6, 1 + 6]  # prefix, then exactly max_new
    assert expected[1].tokens[:2] == [400, 401] and expected[2].tokens[0] == 402
    assert all(0.0 <= row.no_speech_prob <= 1.0 for row in expected)
    assert expected[0].language_token == LANGUAGES[1] and expected[1].language_token in LANGUAGES


def test_a_clips_later_windows_take_its_first_windows_language_even_across_batches() -> None:
    features = audio(6, scale=300.0)[[1, 0, 2, 3]]  # rows whose own languages differ from the first's
    alone = decoder(4, max_new=1).decode(features, [prompt(None) for _ in range(4)])
    detected = [row.language_token for row in alone]
    assert set(detected[1:]) - {detected[0]}  # on their own, the rows would not all agree
    led = [prompt(None), prompt(None, leader=0), prompt(None, leader=0), prompt(None, leader=0)]
    for max_batch in (4, 1):  # one batch; then each row in its own (the leader's language is known)
        rows = decoder(max_batch, max_new=1).decode(features, led)
        assert [row.language_token for row in rows] == [detected[0]] * 4
