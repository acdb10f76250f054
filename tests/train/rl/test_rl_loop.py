"""The GRPO loop's mechanism on a micro model: the policy moves, the engine serves exactly the
trainer's weights after each sync (logprob mismatch ~0), failed rollouts are retried or dropped and
counted, and Ctrl-C leaves a checkpoint that a resumed run continues from."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.train.rl.config import RLConfig
from deltamoe.train.rl.loop import RLRun
from deltamoe.train.rl.rollout import EngineRollouts

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def init(tmp_path_factory, micro_model_config):
    folder = tmp_path_factory.mktemp("rl") / "init"
    save_checkpoint(build_model(micro_model_config.replace(max_position_embeddings=128), seed=2), folder)
    return str(folder)


def _config(init, out, **kw) -> RLConfig:
    base = dict(preset=None, init=init, task="arithmetic", digits=1, steps=2, prompts_per_step=2, group_size=4,
                updates_per_batch=2, lr=3e-3, eval_every=0, eval_prompts=4, save_every=0, out=str(out),
                progress=False, plot=False, threads=1)  # the PNG costs seconds of matplotlib: the slow test draws it
    return RLConfig(**{**base, **kw})


def _parity_reward(run: RLRun):
    # A random micro model never answers a sum: reward an even first byte instead, so groups differ.
    run._reward = lambda s: float(s.token_ids[0] % 2 == 0)


def test_policy_moves_and_the_engine_serves_its_weights(init, tmp_path):
    run = RLRun(_config(init, tmp_path / "run"))
    _parity_reward(run)
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    result = run.run()
    after = run.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    engine = run.engine.runner.model.state_dict()
    assert all(torch.equal(engine[k], after[k]) for k in after)  # the engine holds exactly the trainer's weights
    steps = [r for r in result.records if r["step"] > 0]
    assert [r["weight_version"] for r in steps] == [2, 3]  # one sync at the start, one per step
    for r in steps:
        assert r["logprob_mismatch_max"] < 1e-4 and r["dropped"] == 0
        assert r["clip_fraction"] >= 0 and r["kl"] >= 0 and r["rollout_tokens"] > 0
    assert steps[-1]["kl"] > 0  # the second step's policy differs from the initial one
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2] and logged[-1]["eval_accuracy"] is not None
    assert (tmp_path / "run" / "model" / "config.json").is_file()


# SIGTERM: how schedulers stop a job (a rank killed mid-step lost the run).
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_leaves_a_checkpoint_that_resume_continues(init, tmp_path, sig):
    run = RLRun(_config(init, tmp_path / "run"))
    _parity_reward(run)
    update = run.trainer.update

    def ctrl_c_mid_update(batch, step):  # the signal while step 1 trains: step 1 still completes
        os.kill(os.getpid(), sig)
        return update(batch, step)

    run.trainer.update = ctrl_c_mid_update
    result = run.run()
    assert result.interrupted and result.step == 1
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir()
    resumed = RLRun(_config(init, tmp_path / "run", resume=True))
    _parity_reward(resumed)
    assert resumed._maybe_resume() and resumed.state.step == 1  # (run() loads it again)
    assert all(torch.equal(v, run.policy.state_dict()[k]) for k, v in resumed.policy.state_dict().items())
    result = resumed.run()
    assert result.step == 2 and not result.interrupted
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2] and logged[2]["kl"] > 0
    # The resumed run's fresh engine continues the weight versions (after step k: k + 1), as unbroken.
    assert [r["weight_version"] for r in logged[1:]] == [2, 3]
    # A resume asking for fewer steps than the checkpoint holds is refused, not a silent re-export.
    from deltamoe.errors import ConfigError

    with pytest.raises(ConfigError, match="is at step 2, beyond steps=1") as e:
        RLRun(_config(init, tmp_path / "run", resume=True, steps=1)).run()
    assert e.value.field == "steps" and "--steps 2" in e.value.hint


def test_failed_rollouts_are_retried_then_dropped_never_hang(init, tmp_path):
    run = RLRun(_config(init, tmp_path / "run"))
    prompts = run.prompts.batch("train", 0, 2)
    params = [SamplingParams(max_tokens=2, logprobs=0)] * 2
    real_step, failures = run.engine.step, {"left": 1}

    def flaky_step():
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("a worker died")
        return real_step()

    run.engine.step = flaky_step
    batch = EngineRollouts(run.engine, retries=1, timeout_s=60).sample(prompts, 3, params, seed=0)
    assert batch.retried == 6 and batch.dropped == 0 and [len(g) for g in batch.groups] == [3, 3]
    failures["left"] = 10**9  # every step fails: each request is retried once, then dropped
    batch = EngineRollouts(run.engine, retries=1, timeout_s=60).sample(prompts, 3, params, seed=1)
    assert batch.dropped == 6 and batch.groups == [[], []]
    assert not run.engine.has_unfinished()


def test_forked_choices_sample_what_separate_requests_do(init, tmp_path):
    """A group's choices fork the first one's prefill; each still draws with its own seed."""
    run = RLRun(_config(init, tmp_path / "run"))
    prompts = run.prompts.batch("train", 0, 3)
    params = [SamplingParams(max_tokens=2, logprobs=0, ignore_eos=True)] * 3
    got = {share: EngineRollouts(run.engine, retries=0, timeout_s=60, share_prompt=share).sample(prompts, 4, params, 7)
           for share in (False, True)}
    for separate, forked in zip(got[False].groups, got[True].groups):
        assert len(forked) == 4
        assert sorted(s.token_ids for s in forked) == sorted(s.token_ids for s in separate)
        lp = {tuple(s.token_ids): s.logprobs for s in separate}
        assert all(torch.allclose(torch.tensor(s.logprobs), torch.tensor(lp[tuple(s.token_ids)]), atol=1e-4)
                   for s in forked)
    assert len({tuple(s.token_ids) for g in got[True].groups for s in g}) > 3  # the choices differ


@pytest.mark.parametrize("norm", ["std", "mean"])
def test_rewarded_tokens_get_likelier(init, tmp_path, norm):
    """The sign check on a toy whose right answer is known: rewarding an even first byte raises the
    policy's exact probability of one, on prompts it trained on and on held-out ones."""
    run = RLRun(_config(init, tmp_path / "run", steps=3, prompts_per_step=4, group_size=8, updates_per_batch=1,
                        advantage_norm=norm))
    _parity_reward(run)
    prompts = run.prompts.batch("train", 0, 12) + run.prompts.batch("eval", 0, 8)

    @torch.no_grad()
    def p_even() -> torch.Tensor:
        probs = [torch.softmax(run.policy(torch.tensor([p.token_ids])).logits[0, -1], -1) for p in prompts]
        return torch.stack([p[0:256:2].sum() for p in probs])

    before = p_even()
    run.run()
    after = p_even()
    assert (after > before).all(), (before, after)
    assert float(after.mean() - before.mean()) > 0.01


def test_a_step_whose_groups_all_dropped_trains_nothing_and_goes_on(init, tmp_path):
    """Every rollout past its timeout: the step is logged without a loss (counted as dropped) and
    the run continues, progress shown; it crashed on the missing loss."""
    result = RLRun(_config(init, tmp_path / "run", rollout_timeout_s=1e-6, progress=True)).run()
    assert result.step == 2 and not result.interrupted
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert all(r["groups"] == 0 and r["dropped"] > 0 and "loss" not in r for r in logged[1:])
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_a_new_run_into_a_used_out_and_a_changed_resume_are_refused(init, tmp_path):
    """As for `deltamoe train`: another run's checkpoints in --out (its saves pruned, --resume reading
    the other run) and a resume that changes the policy's settings are one-line errors."""
    from deltamoe.errors import ConfigError
    from deltamoe.train.rl.loop import run_rl

    out = tmp_path / "run"
    run = RLRun(_config(init, out, steps=1))
    _parity_reward(run)
    run.run()
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run") as e:
        run_rl(_config(init, out, steps=1))
    assert e.value.field == "out"
    with pytest.raises(ConfigError, match="was trained with lr=0.003, this run asks for 0.001") as e:
        RLRun(_config(init, out, steps=2, resume=True, lr=1e-3)).run()
    assert e.value.field == "lr"


@pytest.mark.parametrize("field", ["lr", "kl_coef", "format_reward"])
def test_infinite_values_are_refused(field):
    from deltamoe.errors import ConfigError

    with pytest.raises(ConfigError, match="expected a finite number, got inf") as e:
        RLConfig(**{field: float("inf")}).validate()
    assert e.value.field == field


def test_a_second_ctrl_c_during_the_save_does_not_lose_the_run(init, tmp_path, monkeypatch):
    """Under torchrun a terminal's Ctrl-C reaches a worker twice (the terminal's group, then torchrun's
    forward): the second one arrived during the save and cut it short, leaving no checkpoint."""
    from deltamoe.train import checkpoint

    run = RLRun(_config(init, tmp_path / "run"))
    _parity_reward(run)
    update, save = run.trainer.update, checkpoint.save

    def ctrl_c_mid_update(batch, step):
        os.kill(os.getpid(), signal.SIGINT)
        return update(batch, step)

    def ctrl_c_mid_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return save(*args, **kwargs)

    run.trainer.update = ctrl_c_mid_update
    monkeypatch.setattr(checkpoint, "save", ctrl_c_mid_save)
    result = run.run()
    assert result.interrupted and result.step == 1
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir()
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_a_policy_turned_non_finite_stops_the_run_and_saves_nothing_from_it(init, tmp_path):
    """As `deltamoe train` stops on a non-finite loss: the sync after the step finds the NaN, the run
    stops naming the tensor, and neither a checkpoint nor model/ is written from the spoiled weights
    (the engine's weight update refused them with a message about serving)."""
    from deltamoe.errors import TrainingError

    run = RLRun(_config(init, tmp_path / "run", save_every=1, steps=3))
    _parity_reward(run)
    update = run.trainer.update

    def diverging(batch, step):
        record = update(batch, step)
        if step == 2:
            with torch.no_grad():
                run.policy.lm_head.weight.fill_(float("nan"))
        return record

    run.trainer.update = diverging
    with pytest.raises(TrainingError, match=r"after step 2 the policy's lm_head.weight holds non-finite.*step-00000001"):
        run.run()
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").iterdir())] == ["step-00000001"]
    assert not (tmp_path / "run" / "model").exists()
