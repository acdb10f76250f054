"""Prefill chunks of different lengths in one right-padded model call (runner.pack_calls): the
padding never reaches a cache, a KDA state or the logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltamoe.ops.kda_gate import causal_conv1d
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.runner import MAX_PADDING_FRACTION, ModelCall, pack_calls
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.engine.scheduler import ScheduledBatch


def test_conv_state_of_padded_rows_is_the_state_of_their_real_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    x, weight, state = torch.randn(3, 7, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(3, 6, 3, generator=g)
    lengths = torch.tensor([7, 2, 5])
    y, new_state = causal_conv1d(x, weight, state, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        y_b, state_b = causal_conv1d(x[b:b + 1, :n], weight, state[b:b + 1])
        torch.testing.assert_close(y[b:b + 1, :n], y_b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(new_state[b:b + 1], state_b)


def _engine(model) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(cache_memory="8MiB", max_num_seqs=4, block_size=4,
                                                enable_prefix_caching=False))


@pytest.mark.parametrize("fixture", ["k31_model", "kimi_linear_model"])
@torch.inference_mode()
def test_one_padded_call_equals_one_call_per_prompt(fixture: str, request) -> None:
    """Logits, KDA recurrent and conv states, and the stored latents / indexer keys are those of
    each prompt prefilled alone (with past context for one row, so chunked prefill is covered)."""
    model = request.getfixturevalue(fixture)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 5, 9)]

    def run(together: bool):
        engine = _engine(model)
        seqs = [engine.make_sequence(p, SamplingParams(max_tokens=1, temperature=0)) for p in prompts]
        for seq in seqs:
            assert engine.cache.admit(seq) and engine.cache.grow(seq, len(seq.token_ids))
        seqs[0].num_computed = 4  # row 0 already holds 4 tokens: only its last 9 are new
        engine.runner.execute(ScheduledBatch([(seqs[0], 4)]))
        items = [(seq, len(seq.token_ids) - seq.num_computed) for seq in seqs]
        batches = [items] if together else [[item] for item in items]
        logits = {}
        for items_ in batches:
            for call in pack_calls(items_):  # (longest first: map rows back to their sequences)
                out = engine.runner.forward(ModelCall.of(call, compiled_decode=False))
                logits.update({id(s): row for (s, _), row in zip(call, out)})
        if together:
            assert len(pack_calls(items)) == 1  # 9, 5 and 9 tokens: one call, 27 slots for 23 tokens
        cache = engine.cache
        rows = [torch.cat([cache.latent[:, b * 4:(b + 1) * 4] for b in seq.block_table], 1)[:, :len(seq.token_ids)]
                for seq in seqs]
        return (torch.stack([logits[id(s)] for s in seqs]), [cache.recurrent[:, s.slot].clone() for s in seqs],
                [cache.conv[:, s.slot].clone() for s in seqs], rows)

    together, alone = run(True), run(False)
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(together[1] + together[2] + together[3], alone[1] + alone[2] + alone[3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=20))
def test_pack_calls_covers_every_item_once_and_bounds_padding(counts: list[int]) -> None:
    items = [(object(), n) for n in counts]
    calls = pack_calls(items)
    assert sorted(id(s) for call in calls for s, _ in call) == sorted(id(s) for s, _ in items)
    for call in calls:
        ns = [n for _, n in call]
        if max(ns) == 1:
            continue
        assert min(ns) > 1  # decodes never share a call with prefill chunks
        if len(ns) > 1:
            assert len(ns) * max(ns) - sum(ns) <= MAX_PADDING_FRACTION * sum(ns)
