"""`--fp8 blockwise` in the training loop: which modules convert, the per-module error in metrics.jsonl,
and the config checks. (fp8 with FSDP2 + EP equals fp8 on one process: tests/parallel/test_distributed.py.)"""

import pytest
import torch
from torch import nn

from deltamoe.errors import ConfigError
from deltamoe.model.load import build_model
from deltamoe.train.fp8 import Fp8Linear, Fp8LocalExperts, Fp8Training
from deltamoe.train.metrics import read_jsonl
from deltamoe.train.trainer import train
from tests.train.conftest import MICRO_MODEL, micro_config


def test_conversion_keeps_heads_and_names(tmp_path):
    model = build_model(_micro_model_config(), seed=0)
    before = dict(model.named_parameters())
    Fp8Training()(model)
    assert dict(model.named_parameters()).keys() == before.keys()
    assert all(p is before[n] for n, p in model.named_parameters())  # the same Parameters: optimizer, checkpoints
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[2].shared_head.head) is nn.Linear
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert isinstance(model.model.layers[1].block_sparse_moe.dispatcher, Fp8LocalExperts)


def _micro_model_config():
    from deltamoe.config import load_preset

    return load_preset("tiny").replace(**MICRO_MODEL)


def test_fp8_run_logs_per_module_error_and_trains(tmp_path):
    base = train(micro_config(tmp_path / "fp32", **{"run.steps": 2}))
    result = train(micro_config(tmp_path / "fp8", **{"run.steps": 2, "run.fp8": "blockwise"}))
    records = read_jsonl(result.out / "metrics.jsonl")
    errors = records[-1]["fp8_error"]
    assert "model.layers.0.self_attn.q_proj" in errors and "model.layers.1.block_sparse_moe.experts" in errors
    assert "lm_head" not in errors
    # dy is recorded where an input gradient is computed: not in the DSA indexer, which trains apart
    # from the loss's graph.
    assert {n for n, errs in errors.items() if "dy" not in errs} == {"model.layers.1.self_attn.indexer.wq_b",
                                                                   "model.layers.1.self_attn.indexer.wk",
                                                                   "model.layers.1.self_attn.indexer.weights_proj"}
    for name, errs in errors.items():
        errs = {"dy": 0.01, **errs}
        # e4m3 rounds to 3 mantissa bits (<= 6.25 % per element); gradients span more range within a tile,
        # so their small entries fall into e4m3's subnormals and the error is larger.
        assert 0 < errs["x"] < 0.1 and 0 < errs["w"] < 0.1 and 0 < errs["dy"] < 0.5, (name, errs)
    # Quantised, so not the fp32 run's losses, but close to them.
    fp8_loss, fp32_loss = records[-1]["loss"], base.metrics[-1]["loss"]
    assert fp8_loss != fp32_loss and fp8_loss == pytest.approx(fp32_loss, rel=0.02)


def test_config_checks_name_the_field(tmp_path):
    with pytest.raises(ConfigError) as e:
        micro_config(tmp_path, **{"run.fp8": "e5m2"})
    assert e.value.field == "run.fp8"
    with pytest.raises(ConfigError) as e:
        micro_config(tmp_path, **{"run.fp8": "blockwise", "run.fp8_stats_every": 0})
    assert e.value.field == "run.fp8_stats_every"
    with pytest.raises(ConfigError) as e:
        micro_config(tmp_path, **{"run.fp8": "blockwise", "parallel.tp": 2, "parallel.dp": 1})
    assert e.value.field == "run.fp8"


def test_error_statistics_on_step_one_every_nth_and_the_last():
    fp8 = Fp8Training(stats_every=3)
    model = nn.Sequential(nn.Linear(128, 64, bias=False))
    fp8(model)
    recorded = []
    for step in range(1, 8):
        fp8.begin_step(step, last_step=7)
        model(torch.randn(4, 128, requires_grad=True)).sum().backward()  # dy: recorded with an input grad
        errs = fp8.take()
        assert bool(errs) == fp8.recording
        if errs:
            recorded.append(step)
            assert set(errs["0"]) == {"x", "w", "dy"}
    assert recorded == [1, 3, 6, 7]
    with pytest.raises(ValueError, match="stats_every"):
        Fp8Training(stats_every=0)
