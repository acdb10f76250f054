"""Chained MTP training (`mtp_train_depth` > 1): the states and loss of every depth equal a
hand-written reference that runs the one MTP layer the way the drafter does, position by position
through a cache (depth 1 over the prefix, then one call per further depth, one position on)."""

from __future__ import annotations

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.model.cache import ContiguousCache
from deltamoe.model.load import build_model
from deltamoe.model.model import shifted_cross_entropy
from deltamoe.model.mtp_chain import mtp_states

DEPTH = 3
T = 9


def drafted_states(model, ids: torch.Tensor, h: torch.Tensor, chain: int, depth: int) -> list[torch.Tensor]:
    """Depth 1 .. depth states of chain `chain` [B, D], as the drafter computes them: the MTP layer
    over positions 0..chain with a cache, then one position per further depth."""
    mtp, embed = model.model.mtp_layers[0], model.model.embed_tokens
    cache = ContiguousCache(model.config, ids.shape[0], T + depth)
    prev = mtp(h[:, :chain + 1], embed(ids[:, 1:chain + 2]), cache)[:, -1:]
    cache.advance(chain + 1)
    states = [prev[:, 0]]
    for k in range(2, depth + 1):
        prev = mtp(prev, embed(ids[:, chain + k:chain + k + 1]), cache)
        cache.advance(1)
        states.append(prev[:, 0])
    return states


@pytest.mark.parametrize("member", ["k3", "rope_mla"])
def test_chained_states_and_loss_equal_the_drafting_reference(configs, member):
    extra = {"num_nextn_predict_layers": 1, "attn_res_block_size": None} if member == "rope_mla" else {}
    model = build_model(configs[member](mtp_train_depth=DEPTH, **extra), seed=5).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, labels=ids)
        states = mtp_states(model.model.mtp_layers, out.hidden_states, model.model.embed_tokens(ids), DEPTH)
        assert [s.shape[1] for s in states] == [T - 1, T - 2, T - 3]
        for chain in range(T - DEPTH):
            for k, ref in enumerate(drafted_states(model, ids, out.hidden_states, chain, DEPTH), start=1):
                torch.testing.assert_close(states[k - 1][:, chain], ref, atol=2e-5, rtol=1e-4)
        mtp = model.model.mtp_layers[0]
        losses = [shifted_cross_entropy(mtp.logits(s), ids[:, k:], shift=1) for k, s in enumerate(states, start=1)]
    torch.testing.assert_close(out.mtp_loss, torch.stack(losses).mean())
    torch.testing.assert_close(out.loss, out.lm_loss + model.mtp_weight * out.mtp_loss)


def test_depth_one_is_the_plain_mtp_pass(configs):
    model = build_model(configs["k3"](), seed=5).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids, labels=ids)
        mtp = model.model.mtp_layers[0]
        state = mtp(out.hidden_states[:, :-1], model.model.embed_tokens(ids[:, 1:]))
        torch.testing.assert_close(out.mtp_loss, shifted_cross_entropy(mtp.logits(state), ids[:, 1:], shift=1))


def test_chained_depth_needs_exactly_one_mtp_layer(configs):
    for bad in ({"num_nextn_predict_layers": 2, "mtp_train_depth": 2}, {"mtp_train_depth": 0}):
        with pytest.raises(ConfigError) as err:
            configs["k3"](**bad)
        assert err.value.field == "mtp_train_depth"
