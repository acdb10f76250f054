"""One process: chained ModelStages with the global-token loss reproduce the model's loss and gradients.

This is the pipeline's data path (stage split, (h, bank) packing, the last stage's head and MTP
logits, loss normalisation) checked without processes; test_distributed.py runs it across ranks.
"""

import sys
from pathlib import Path

import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.parallel.loss import GlobalTokenLoss, target_counts
from deltamoe.parallel.stage_module import ModelStage
from deltamoe.parallel.stage_split import split_stages

sys.path.insert(0, str(Path(__file__).parent))
from dist_job import global_batch, k31_toy, kimi_linear_toy  # noqa: E402


def chained_mtp_toy():
    return k31_toy(mtp_train_depth=3)


@pytest.mark.parametrize("make_config, num_stages",
                         [(k31_toy, 1), (k31_toy, 4), (kimi_linear_toy, 3), (chained_mtp_toy, 2)])
def test_chained_stages_equal_the_model(make_config, num_stages):
    config = make_config()
    ids, labels = global_batch(config)
    reference = build_model(config, seed=0)
    ref = reference(ids, labels=labels)
    ref.loss.backward()

    model = build_model(config, seed=0)
    ranges = split_stages(config, num_stages)
    stages = [ModelStage(model, r, first=i == 0, last=i == num_stages - 1) for i, r in enumerate(ranges)]
    loss_fn = GlobalTokenLoss(config.mtp_depths, model.mtp_weight)
    loss = 0.0
    for half in (slice(0, 1), slice(1, None)):  # two microbatches of unequal token counts
        loss_fn.counts = target_counts(labels, config.mtp_depths)
        x = ids[half]
        for stage in stages:
            x = stage(x)
        if num_stages > 1 and config.attn_res_block_size:
            assert x.shape[1] > ids.shape[1]  # next-token and MTP logits side by side
        mb_loss = loss_fn(x, labels[half])
        mb_loss.backward()
        loss += float(mb_loss.detach())

    assert loss == pytest.approx(float(ref.loss.detach()), rel=1e-6)
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == {n for n, _ in reference.named_parameters()}  # published names, nothing lost
    for (n, p), (rn, rp) in zip(sorted(model.named_parameters()), sorted(reference.named_parameters())):
        if rp.grad is None:
            assert p.grad is None, n
        else:
            assert torch.allclose(p.grad, rp.grad, rtol=1e-5, atol=1e-7), n


def test_stage_state_carries_the_bank():
    config = k31_toy()  # blocks of 2 layers: a stage starting at layer 4 receives [embeddings, block 0, block 1]
    model = build_model(config, seed=0)
    ids, _ = global_batch(config)
    first = ModelStage(model, range(0, 4), first=True, last=False)
    state = first(ids)
    assert state.shape == (ids.shape[0], ids.shape[1], 3, config.hidden_size)
    assert torch.equal(state[:, :, 0], model.model.embed_tokens(ids))
