"""GRPO's pieces against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from deltamoe.errors import ConfigError
from deltamoe.train.rl.config import RLConfig
from deltamoe.train.rl.grpo import group_advantages, grpo_loss, token_logprobs
from deltamoe.train.rl.rewards import reward


def test_group_advantages_normalise_within_each_group():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))  # no signal in a group of equal rewards
    # "mean": (r - mean) / mean, the gradient of log pass rate; an all-wrong group stays at zero
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]), "mean")
    assert torch.allclose(adv[0], torch.tensor([3.0, -1.0, -1.0, -1.0]), atol=1e-4)
    assert torch.equal(adv[1], torch.zeros(4))


def test_token_logprobs_pick_the_next_tokens():
    logits = torch.randn(2, 5, 7)
    tokens = torch.randint(0, 7, (2, 5))
    got = token_logprobs(logits, tokens, temperature=2.0)
    want = torch.log_softmax(logits[0, 1] / 2.0, -1)[tokens[0, 2]]
    assert got.shape == (2, 4) and torch.allclose(got[0, 1], want)


def test_clipped_loss_kl_and_clip_fraction():
    old = torch.zeros(1, 4)
    logp = torch.tensor([[0.0, math.log(1.5), math.log(0.5), 0.0]])  # ratios 1, 1.5, 0.5, 1
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = grpo_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2, ref_logp=torch.zeros(1, 4), kl_coef=0.5)
    # A = 1: min(r, clip(r)) = 1, 1.2, 0.5 -> policy loss -(2.7) / 3; only the 1.5 ratio is clipped.
    assert out.policy_loss == pytest.approx(-2.7 / 3)
    assert out.clip_fraction == pytest.approx(1 / 3)
    kl = [math.exp(-v) + v - 1 for v in (0.0, math.log(1.5), math.log(0.5))]
    assert out.kl == pytest.approx(sum(kl) / 3, rel=1e-5)
    assert float(out.loss) == pytest.approx(-2.7 / 3 + 0.5 * sum(kl) / 3, rel=1e-5)


def test_rewards_and_config_checks():
    digits = frozenset("0123456789")
    assert reward("12", "stop", "12", "stop", digits, 0.1) == pytest.approx(1.1)
    assert reward("13", "stop", "12", "stop", digits, 0.1) == pytest.approx(0.1)
    assert reward("12", "length", "12", "stop", digits, 0.1) == pytest.approx(1.0)  # right, but never stopped
    assert reward("1x", "length", "12", "length", digits, 0.1) == 0.0
    for bad, field in [({"task": "copy"}, "task"), ({"group_size": 1}, "group_size"), ({"clip_eps": 1.5}, "clip_eps"),
                       ({"init": "x"}, "init"),
                       ({"completion": "free"}, "completion")]:
        with pytest.raises(ConfigError) as e:
            RLConfig(**bad).validate()
        assert e.value.field == field


def test_cli_bad_input_is_one_line_and_exit_2(capsys):
    from deltamoe.cli import main

    assert main(["rl", "--task", "copy"]) == 2
    assert capsys.readouterr().err.strip() == "error: task: expected one of arithmetic, recall, got 'copy'"
    assert main(["rl", "--preset", "tiny", "--init", "runs/x/model"]) == 2
    assert "init" in capsys.readouterr().err
    for init in ("/nonexistent", "tiny"):  # named --init, not "model" / "tokenizer" after loading
        assert main(["rl", "--init", init, "--task", "arithmetic"]) == 2
        assert capsys.readouterr().err.startswith(f"error: init: expected a checkpoint folder, got '{init}'")
    for out, message in [("", "error: out: empty path"), ("/proc/deltamoe-rl", "error: out: cannot write into")]:
        assert main(["rl", "--task", "arithmetic", "--steps", "1", "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(message), err


def test_help_and_bad_input_never_import_torch():
    import json
    import subprocess
    import sys

    probe = ("import contextlib, io, json, sys\nfrom deltamoe.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
             "    rcs = [main(['rl', '--help']), main(['rl', '--group-size', '1'])]\n"
             "print(json.dumps([rcs, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout) == [[0, 2], False], out.stderr


def test_wilson_interval():
    from deltamoe.train.rl.accuracy import wilson_interval

    z = 1.96
    assert wilson_interval(0, 10) == pytest.approx((0.0, z * z / (10 + z * z)))  # closed form at p = 0
    lo, hi = wilson_interval(224, 512)
    assert lo < 224 / 512 < hi and hi - lo == pytest.approx(0.0856, abs=1e-3)
    assert wilson_interval(288, 512) == pytest.approx(tuple(1 - v for v in reversed((lo, hi))))  # p <-> 1 - p
    assert wilson_interval(448, 1024)[1] - wilson_interval(448, 1024)[0] < hi - lo  # more prompts, narrower


def test_data_rank_blocks_sum_to_the_whole_batch_loss():
    from deltamoe.train.rl.batch import RolloutTensors

    torch.manual_seed(0)
    row = torch.tensor([0, 0, 1, 2, 2, 3, 4])  # 5 rows, 7 scored tokens
    n = row.numel()
    b = RolloutTensors(torch.randint(0, 9, (5, 4)), row, torch.randint(0, 3, (n,)), torch.randint(0, 9, (n,)),
                       torch.tensor([1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0]), torch.randn(n), torch.zeros(n))
    logp, old = torch.randn(n), torch.randn(n)
    whole = grpo_loss(logp, old, b.advantage, b.weight, 0.2).loss
    tokens = b.weight.sum()
    parts = []
    for rank in range(2):
        blk = b.block(rank, 2)
        mine = (row >= rank * 3) & (row < rank * 3 + 3)
        assert blk.ids.shape[0] == 3  # every rank the same number of rows
        assert torch.equal(blk.ids[blk.row], b.ids[row[mine]])  # each token scored on its own row
        parts.append(grpo_loss(logp[mine], old[mine], blk.advantage, blk.weight, 0.2, tokens=tokens).loss)
    assert torch.equal(b.block(1, 2).ids[2], b.ids[0]) and not (b.block(1, 2).row == 2).any()  # the pad row
    assert float(parts[0] + parts[1]) == pytest.approx(float(whole), rel=1e-6)


def test_sgd_option_moves_the_weights_along_the_clipped_gradient():
    from deltamoe.train.rl.policy import SGDOptimizers

    with pytest.raises(ConfigError) as e:
        RLConfig(optimizer="adam").validate()
    assert e.value.field == "optimizer"
    layer = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in layer.parameters()]
    opt = SGDOptimizers([layer], lr=0.1, warmup_steps=2, total_steps=10)
    (layer(torch.ones(2, 4)) ** 2).sum().backward()
    torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    grads = [p.grad.clone() for p in layer.parameters()]
    assert opt.set_lr(1) == pytest.approx(0.05)  # the linear warmup
    opt.step()
    for p, b, g in zip(layer.parameters(), before, grads):
        assert torch.allclose(p.detach(), b - 0.05 * g)
