"""`--init-optimizer`: the RL trainer's AdamW starts from a supervised checkpoint's step count and second
moments (first moment zero), and keeps its own hyperparameters (lr schedule, no weight decay)."""

from __future__ import annotations

import copy

import pytest
import torch

from deltamoe.errors import CheckpointError, ConfigError
from deltamoe.model.load import build_model
from deltamoe.train import checkpoint
from deltamoe.train.config import OptimSection
from deltamoe.train.optim import Optimizers
from deltamoe.train.rl.config import RLConfig
from deltamoe.train.rl.policy import PolicyTrainer

torch.set_num_threads(1)


def _supervised_checkpoint(model: torch.nn.Module, out) -> tuple[checkpoint.Path, Optimizers]:
    """Two AdamW steps of a next-token loss with the train stack's optimizer (weight decay 0.1), saved."""
    optimizers = Optimizers([model], OptimSection(lr=3e-3, warmup_steps=0, weight_decay=0.1), total_steps=10)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        logits = model(ids).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizers.step()
        optimizers.zero_grad()
    return checkpoint.save(out, [model], optimizers, checkpoint.TrainState(step=2), keep=1), optimizers


def test_rl_adamw_starts_from_the_supervised_second_moments(micro_model_config, tmp_path):
    model = build_model(micro_model_config, seed=3)
    path, sft = _supervised_checkpoint(model, tmp_path / "sft")
    cfg = RLConfig(init_optimizer=str(path), lr=1e-4, steps=3, updates_per_batch=1).validate()
    trainer = PolicyTrainer(copy.deepcopy(model).train(), cfg, None)
    (adamw,) = trainer.optimizers.optimizers
    expected = {n: sft.optimizers[0].state[p] for n, p in model.named_parameters() if p in sft.optimizers[0].state}
    loaded = {n: adamw.state[p] for n, p in trainer.module.named_parameters() if p in adamw.state}
    assert len(expected) > 10 and set(expected) <= set(loaded)
    assert sum(int(state["exp_avg"].any()) for state in expected.values()) > 10
    for name, state in expected.items():
        assert float(loaded[name]["step"]) == 2.0  # past AdamW's bias-corrected start
        assert torch.equal(loaded[name]["exp_avg_sq"], state["exp_avg_sq"]), name
        assert not loaded[name]["exp_avg"].any()  # the supervised direction is not carried
    assert all(g["weight_decay"] == 0.0 for g in adamw.param_groups)  # RL's own hyperparameters stay
    assert trainer.optimizers.set_lr(3) == pytest.approx(1e-4)


def test_init_optimizer_bad_input_names_the_field(micro_model_config, tmp_path):
    with pytest.raises(ConfigError) as e:
        RLConfig(init_optimizer=str(tmp_path), optimizer="sgd").validate()
    assert e.value.field == "init_optimizer"
    cfg = RLConfig(init_optimizer=str(tmp_path / "missing")).validate()
    with pytest.raises(CheckpointError) as e:
        PolicyTrainer(build_model(micro_model_config, seed=3).train(), cfg, None)
    assert e.value.field == "init_optimizer" and "missing" in str(e.value)
