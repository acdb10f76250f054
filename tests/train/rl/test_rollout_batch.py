"""The shared rollout layout (`batch.py`: one row per prompt + completion[:-1], identical completions
counted) against the plain one (one row per sample): the same loss and the same gradient."""

from __future__ import annotations

import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.parallel.eval_forward import next_token_logits
from deltamoe.train.rl.batch import rollout_tensors, scored_logprobs
from deltamoe.train.rl.grpo import grpo_loss
from deltamoe.train.rl.prompts import Prompt
from deltamoe.train.rl.rollout import Sample

torch.set_num_threads(1)


def _samples(completions: list[list[list[int]]], prompts: list[list[int]]) -> list[Sample]:
    out = []
    for i, (group, ids) in enumerate(zip(completions, prompts)):
        prompt = Prompt("", ids, "")
        out += [Sample(i, prompt, c, [-0.1 * (k + 1)] * len(c)) for k, c in enumerate(group)]
    return out


def _loss_and_grads(model, batch, old_shift: float):
    logp = scored_logprobs(next_token_logits(model, batch.ids), batch)
    old = logp.detach() - old_shift  # ratios away from 1, so that the clip acts on some tokens
    out = grpo_loss(logp, old, batch.advantage, batch.weight, clip_eps=0.2, ref_logp=old, kl_coef=0.1)
    model.zero_grad()
    out.loss.backward()
    return out, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("one_token", [True, False])
def test_shared_rows_and_counted_duplicates_equal_the_plain_loss(micro_model_config, one_token):
    model = build_model(micro_model_config, seed=3)
    prompts = [[256, 40, 41, 42], [256, 50, 51]]
    if one_token:  # recall's shape: every completion one token, so each prompt is forwarded once
        groups = [[[7], [9], [7], [7]], [[5], [5], [5], [6]]]
    else:  # repeats, and completions that differ only in their last token (one row)
        groups = [[[7, 8], [7, 9], [7, 8], [3, 3]], [[5, 1], [5, 1], [6, 2], [5, 1]]]
    samples = _samples(groups, prompts)
    rewards = [float(s.token_ids[-1] % 2) for s in samples]
    advantages = [r - 0.5 for r in rewards]  # identical completions: identical rewards and advantages
    plain = rollout_tensors(samples, advantages, pad=258, plain=True)
    shared = rollout_tensors(samples, advantages, pad=258)
    assert plain.ids.shape[0] == 8 and shared.ids.shape[0] == (2 if one_token else 4)
    assert shared.weight.sum() == plain.weight.sum() == sum(len(s.token_ids) for s in samples)
    want, want_grads = _loss_and_grads(model, plain, old_shift=0.3)
    got, got_grads = _loss_and_grads(model, shared, old_shift=0.3)
    assert float(got.loss.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-5)
    assert got.kl == pytest.approx(want.kl, rel=1e-5) and got.clip_fraction == pytest.approx(want.clip_fraction)
    assert want.clip_fraction > 0
    for g, w in zip(got_grads, want_grads):
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-4)


def test_identical_completions_with_different_advantages_are_refused():
    samples = _samples([[[7], [7]]], [[256, 40]])
    with pytest.raises(ValueError, match="different advantages"):
        rollout_tensors(samples, [1.0, -1.0], pad=258)


def test_micro_batched_update_equals_one_forward(micro_model_config):
    import copy

    from deltamoe.train.rl.config import RLConfig
    from deltamoe.train.rl.policy import PolicyTrainer

    policy = build_model(micro_model_config, seed=4).train()
    samples = _samples([[[7], [9], [7]], [[5], [6], [6]], [[1], [2], [3]]], [[256, 40, 41], [256, 50], [256, 60, 61, 62]])
    batch = rollout_tensors(samples, [0.5, -1.0, 0.5, -0.5, 0.25, 0.25, 1.0, 0.0, -1.0], pad=258)
    got = {}
    for micro in (64, 2):  # one forward, or two micro-batches (the second padded)
        cfg = RLConfig(lr=1e-2, updates_per_batch=2, micro_rows=micro)
        trainer = PolicyTrainer(copy.deepcopy(policy), cfg, None)
        got[micro] = trainer.update(batch, 1), trainer.module.state_dict()
    (one, w_one), (two, w_two) = got[64], got[2]
    for key in ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm", "logprob_mismatch"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    assert one["kl"] > 0
    assert all(torch.allclose(w_two[k], w_one[k], atol=1e-6) for k in w_one)
