"""Smoke test of the loop under 2-process data parallelism (gloo, as torchrun would start it).
Loss equality with one process is the parallel layer's test; here: the loop, its logs,
its per-rank checkpoint files and the export all work with world size 2."""

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from deltamoe.model.load import load_model
from deltamoe.train.metrics import read_jsonl
from tests.train.conftest import micro_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DP2 = {"parallel.dp": 2, "run.steps": 2, "data.batch_size": 4, "data.eval_rows": 4, "balance.alpha": 0.01}
# Two stages (the micro model's two AttnRes blocks), evaluated after each step through the stages.
PP2 = {"parallel.pp": 2, "parallel.microbatches": 2, "run.steps": 2, "run.eval_every": 1, "data.batch_size": 4,
       "data.eval_rows": 6}


def _rank_main(rank: int, world: int, port: int, out: str, errors, sections: dict = DP2) -> None:
    import torch

    from deltamoe.train.trainer import train

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        train(micro_config(out, **sections))
    except Exception as e:  # reported to the parent, which decides between skip and failure
        errors.put(f"{type(e).__name__}: {e}")
        raise


def _run_two_ranks(out, sections: dict) -> None:
    port = _free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, str(out), errors, sections)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    message = None if errors.empty() else errors.get()
    assert all(p.exitcode == 0 for p in procs), message


@pytest.mark.slow  # ~20-40 s: two spawned interpreters importing torch
def test_two_process_data_parallel_run(tmp_path):
    out = tmp_path / "run"
    _run_two_ranks(out, DP2)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all("mtp_loss" in m and "balance_loss" in m for m in metrics)
    ckpt = out / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in ckpt.glob("train_state.rank*.json")) == ["train_state.rank0.json",
                                                                           "train_state.rank1.json"]
    assert json.loads((ckpt / "train_state.rank1.json").read_text())["data_position"] == 8
    assert load_model(out / "model").config.hidden_size == 32


@pytest.mark.slow  # ~30-60 s: two spawned interpreters, two steps, three evaluations
def test_a_pipeline_run_is_evaluated_as_its_exported_model_is(tmp_path):
    """A --pp 2 run evaluates through its stages (each step and at the end); the closing evaluation
    equals one process evaluating the exported model on the same held-out rows."""
    from deltamoe.parallel.api import LocalModel
    from deltamoe.train.data import build_data
    from deltamoe.train.evaluate import evaluate, summarize
    from deltamoe.train.model_setup import resolve_model_config

    out = tmp_path / "run"
    _run_two_ranks(out, PP2)
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [1, 2] and all(e["loss"] > 0 for e in evals)
    final = json.loads((out / "eval.json").read_text())
    cfg = micro_config(out, **{k: v for k, v in PP2.items() if not k.startswith("parallel.")})  # one process
    data = build_data(cfg, resolve_model_config(cfg.model))
    pm = LocalModel(load_model(out / "model").float())
    alone = summarize(evaluate(pm, data, cfg.micro_batch_size * cfg.optim.grad_accum), data.scores_answers)
    assert final["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    assert final["accuracy"] == alone["accuracy"] and final["answers"] == alone["answers"] > 0
