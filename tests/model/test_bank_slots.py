"""The decoder layers with the AttnRes bank as one fixed-size tensor (`model/bank_slots.py`, the form a
compiled layer region traces) give the list form's results, on random weights and inputs."""

from __future__ import annotations

import pytest
import torch

from deltamoe.model.bank_slots import BankSlots, trunk_with_bank_slots
from deltamoe.model.cache import ContiguousCache
from deltamoe.model.load import build_model

from .conftest import k31_config


@pytest.mark.parametrize("layers, block", [(6, 2), (5, 2), (7, 3)])
@torch.inference_mode()
def test_bank_slots_trunk_equals_the_list_trunk(layers: int, block: int) -> None:
    """Blocks that divide the layers and ones that do not; a prefill then one decode step through a
    cache (so the cache writes of each layer are the list form's too)."""
    types = ("kda", "kda", "dsa", "kda", "dsa", "kda", "dsa")[:layers]
    config = k31_config(num_hidden_layers=layers, layer_types=types, attn_res_block_size=block,
                        num_nextn_predict_layers=0)
    model = build_model(config, seed=11).eval()
    plan = BankSlots.plan(config, torch.device("cpu"))
    assert plan.slots == -(-layers // block) + 1
    ids = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(layers))
    caches = [ContiguousCache(config, batch_size=2, max_length=10) for _ in range(2)]
    for step in (ids[:, :8], ids[:, 8:]):
        h = model.model.embed_tokens(step)
        want = model.model(step, caches[0])
        got = trunk_with_bank_slots(model.model, h, caches[1], plan)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for cache in caches:
            cache.advance(step.shape[1])


def test_bank_slots_refuse_a_model_without_attn_res() -> None:
    with pytest.raises(ValueError, match="attn_res_block_size"):
        BankSlots.plan(k31_config(attn_res_block_size=None), torch.device("cpu"))
