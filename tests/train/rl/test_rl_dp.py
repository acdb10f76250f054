"""`deltamoe rl --dp 2` under torchrun: the trainer FSDP2-sharded over two ranks, rank 0 owning the
engine. A few steps give the losses and weights of one process on the same global batch (within
float tolerance: the gradient sums run in another order), and the engine serves the gathered weights."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from deltamoe.config import load_preset
from deltamoe.model.load import build_model, load_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.train.rl.config import RLConfig
from tests.train.conftest import MICRO_MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(init: str, out: str) -> RLConfig:
    # 3 prompts x 3 completions = 9 rows: rank 1 gets 4 real rows and one empty pad row.
    return RLConfig(preset=None, init=init, task="arithmetic", digits=1, steps=3, prompts_per_step=3, group_size=3,
                    updates_per_batch=2, lr=3e-3, eval_every=0, eval_prompts=4, save_every=0, out=out,
                    progress=False, plot=False, threads=1)


def _run(init: str, out: str, mesh=None) -> dict:
    from deltamoe.train.rl.loop import RLRun
    from deltamoe.train.rl.weight_push import policy_tensors

    run = RLRun(_config(init, out), mesh)
    # A random micro model never answers a sum: reward an even first byte instead, so groups differ.
    run._reward = lambda s: float(s.token_ids[0] % 2 == 0)
    result = run.run()
    full = policy_tensors(run.policy)  # every rank gathers
    if run.engine is not None:
        engine = run.engine.runner.model.state_dict()
        assert all(torch.equal(engine[k], v) for k, v in full.items())  # the engine holds the gathered weights
    return {"records": result.records, "weights": full}


def _rank_main(rank: int, world: int, port: int, init: str, out: str, errors) -> None:
    import torch.distributed as dist

    from deltamoe.parallel.dims import ParallelDims
    from deltamoe.parallel.mesh import build_mesh

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        got = _run(init, out, build_mesh(ParallelDims(dp=world), "cpu"))
        if rank == 0:
            torch.save(got, os.path.join(out, "dp_result.pt"))
        dist.destroy_process_group()
    except Exception as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


@pytest.mark.slow  # ~1 min: two spawned interpreters importing torch, plus the one-process reference
def test_dp2_trainer_matches_one_process_and_the_engine_sees_it(tmp_path):
    torch.set_num_threads(1)
    init = str(tmp_path / "init")
    config = load_preset("tiny").replace(**MICRO_MODEL, max_position_embeddings=128)
    save_checkpoint(build_model(config, seed=2), init)
    one = _run(init, str(tmp_path / "one"))

    out = tmp_path / "dp"
    out.mkdir()
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, init, str(out), errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    message = None if errors.empty() else errors.get()
    assert all(p.exitcode == 0 for p in procs), message
    dp = torch.load(out / "dp_result.pt", weights_only=False)

    steps = [r for r in one["records"] if r["step"] > 0]
    dp_steps = [r for r in dp["records"] if r["step"] > 0]
    assert [r["step"] for r in dp_steps] == [1, 2, 3]
    for a, b in zip(steps, dp_steps):
        assert a["rollout_tokens"] == b["rollout_tokens"] and a["reward_mean"] == b["reward_mean"]  # same samples
        assert a["completion_tokens"] == b["completion_tokens"]
        for key in ("loss", "policy_loss", "kl", "clip_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["logprob_mismatch_max"] < 1e-4 and b["weight_version"] == a["weight_version"]
    assert any(abs(r["policy_loss"]) > 0 for r in steps)  # there was something to learn from
    initial = load_model(init).state_dict()
    moved = [k for k, v in one["weights"].items() if not torch.equal(v, initial[k])]
    assert moved  # the policy changed
    for k, v in one["weights"].items():
        torch.testing.assert_close(dp["weights"][k], v, rtol=1e-4, atol=1e-5)
    exported = load_model(out / "model").state_dict()  # rank 0 wrote the gathered weights
    assert all(torch.equal(exported[k], v) for k, v in dp["weights"].items())
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
