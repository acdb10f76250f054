import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.parallel.api import LocalModel
from deltamoe.parallel.expert_load import moe_modules
from deltamoe.train.balance import (SequenceBalanceLoss, balance_step, load_stats, sequence_balance_loss,
                                    update_router_biases)
from tests.train.conftest import MICRO_MODEL


@pytest.fixture(scope="module")
def model():
    from deltamoe.config import load_preset

    return build_model(load_preset("tiny").replace(**{**MICRO_MODEL, "layer_types": ("kda", "dsa")})).train()


def test_bias_moves_toward_balance(model):
    layers = dict(enumerate(moe_modules(model)))
    assert len(layers) == 2  # layer 1 and the MTP layer
    # Layer 1: mean 4, expert 0 overloaded, 1 and 3 underloaded, 2 balanced. MTP layer: balanced.
    load = torch.tensor([[10, 2, 4, 0], [3, 3, 3, 3]])
    update_router_biases(layers, load, gamma=0.01)
    assert layers[0].gate.e_score_correction_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    assert layers[1].gate.e_score_correction_bias.tolist() == [0.0] * 4
    # Selection follows: with equal router scores the overloaded expert is no longer among the top-2.
    _, picked = layers[0].gate(torch.zeros(1, 32))
    assert 0 not in picked.tolist()[0]
    layers[0].gate.e_score_correction_bias.zero_()


def test_load_stats():
    stats = load_stats(torch.tensor([[4, 4, 4, 4], [8, 0, 4, 4]]))
    assert stats == {"expert_load_max_mean": pytest.approx(1.5), "expert_load_max_mean_worst": pytest.approx(2.0)}


def test_step_result_carries_the_expert_load_and_balance_step_applies_it(model):
    pm = LocalModel(model)
    layers = pm.moe_layers
    ids = torch.randint(0, 256, (2, 8))
    first = pm.forward_backward(ids, ids).expert_load
    assert first.shape == (2, 4) and first.dtype == torch.int64
    assert first[0].sum() == 2 * 8 * 2 and first[1].sum() == 2 * 7 * 2  # tokens * top-k; MTP sees T - 1
    second = pm.forward_backward(ids, ids).expert_load
    assert second.tolist() == first.tolist()  # each result holds its own forward only
    model.zero_grad()
    stats = balance_step(layers, first + second, 0.5)
    expected = 0.5 * torch.sign((2 * first[0]).float().mean() - 2 * first[0])
    assert layers[0].gate.e_score_correction_bias.tolist() == pytest.approx(expected.tolist())
    assert stats["expert_load_max_mean"] >= 1.0 and "router_bias_abs_mean" in stats
    for layer in layers.values():
        layer.gate.e_score_correction_bias.zero_()


def test_sequence_balance_loss_values():
    # One sequence, 2 tokens, 2 experts, top-1, uniform scores: perfectly balanced -> 1.
    scores = torch.full((1, 2, 2), 0.5)
    assert sequence_balance_loss(scores, torch.tensor([[[0], [1]]]), top_k=1).item() == pytest.approx(1.0)
    # Both tokens pick expert 0, which also has all the normalized score mass: f = (2, 0), P = (1, 0) -> 2.
    scores = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    assert sequence_balance_loss(scores, torch.tensor([[[0], [0]]]), top_k=1).item() == pytest.approx(2.0)


def test_sequence_balance_term_reaches_router_gradients_without_changing_the_loss(model):
    layers = moe_modules(model)
    ids = torch.randint(0, 256, (2, 8))
    model.zero_grad()
    plain = model(ids, labels=ids).loss
    plain.backward()
    plain_loss_grad = layers[0].gate.weight.grad.clone()
    term = SequenceBalanceLoss(layers, alpha=0.5, grad_scale=1.0)
    model.zero_grad()
    out = model(ids, labels=ids)
    assert out.loss.item() == plain.item()
    out.loss.backward()
    value = term.take()
    assert value is not None and value > 0 and term.take() is None
    # The router of layer 1 gets the extra gradient; the other weights see the same loss.
    assert not torch.allclose(layers[0].gate.weight.grad, plain_loss_grad)
    term.remove()
    model.zero_grad()
