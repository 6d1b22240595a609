"""Random ("dummy") weights with a borrowed tokenizer: the 8B shape is benchmarked this way, with a
vocabulary (128,256) larger than the embedded tokenizer's (49,152). Every id the random model
samples must still reach clients as text, and ordinary text must encode as before."""

from __future__ import annotations

import json

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer

VOCAB = 60_000  # above SmolLM2's 49,152


def test_a_larger_random_vocabulary_pads_the_borrowed_tokenizer(tmp_path, llm_gguf_path):
    config = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path / "config.json"), load_format="dummy", tokenizer=str(llm_gguf_path), num_kv_blocks=16, device="cpu")
    plain = Tokenizer.load(llm_gguf_path)
    assert plain.vocab_size < VOCAB == llm.tokenizer.vocab_size
    question = "How do I apply for annual leave?"
    assert llm.tokenizer.encode(question) == plain.encode(question)
    out = llm.generate([llm.tokenizer.encode(question)], SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=0))[0]
    assert max(out.token_ids) >= plain.vocab_size  # the random model does sample the padded ids ...
    assert all(llm.tokenizer.decode([t]) for t in out.token_ids)  # ... and each one has a text
    assert llm.tokenizer.decode([max(out.token_ids)]).startswith(" ~") and " ~" in out.text
