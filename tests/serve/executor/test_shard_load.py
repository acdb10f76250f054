"""Each --tp/--ep rank reads only its shard from the checkpoint (`executor/shard_load.py`): the result
equals the whole model loaded and cut by the serving plans, tensor for tensor and module for module;
a rank holds 1/ep of the routed experts and never opens a file that holds only other ranks' experts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from deltamoe.model.load import build_model
from deltamoe.model.weights import checkpoint_files, save_checkpoint
from tests.serve.conftest import k31_tiny

JOB = Path(__file__).with_name("shard_load_job.py")


def run_job(tp: int, ep: int, dtype: str, ckpt: Path, rank0_ckpt: Path, out: Path) -> list[dict]:
    done = subprocess.run([sys.executable, str(JOB), str(tp), str(ep), dtype, str(ckpt), str(rank0_ckpt), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def other_ranks_expert_files(ckpt: Path, num_experts: int, ep: int) -> list[str]:
    """The files of `ckpt` that hold only routed experts of EP ranks other than 0."""
    mine = range(num_experts // ep)
    files = []
    for shard in checkpoint_files(ckpt):
        with safe_open(str(ckpt / shard), "pt") as f:
            names = list(f.keys())
        experts = [int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n]
        if len(experts) == len(names) and not any(e in mine for e in experts):
            files.append(shard)
    return files


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tied-embedding model with an MTP layer, saved about one tensor per file, and a copy whose
    files of rank 1's experts are broken (rank 0 must not read them)."""
    root = tmp_path_factory.mktemp("shard-load")
    config = k31_tiny(num_nextn_predict_layers=1, tie_word_embeddings=True, vocab_size=264)
    save_checkpoint(build_model(config, seed=5).eval(), root / "ckpt", max_shard_bytes=1024)
    shutil.copytree(root / "ckpt", root / "broken")
    broken = other_ranks_expert_files(root / "ckpt", config.num_experts, 2)
    assert len(broken) >= 3 * 4  # w1/w3/w2 of rank 1's two experts in every MoE layer, one file each
    for name in broken:
        (root / "broken" / name).write_bytes(b"not safetensors")
    return root


@pytest.mark.parametrize("tp, ep, dtype", [(2, 1, "bfloat16"), (1, 2, "float32")])
def test_a_rank_reads_only_its_shard_and_equals_the_whole_model_cut(checkpoints, tmp_path, tp, ep, dtype):
    ckpt = checkpoints / "ckpt"
    rank0 = checkpoints / ("broken" if ep > 1 else "ckpt")
    ranks = run_job(tp, ep, dtype, ckpt, rank0, tmp_path / "out.json")
    for rank, result in enumerate(ranks):
        assert result["differ"] == [], f"rank {rank}"
        assert result["type_differ"] == [], f"rank {rank}"
        assert result["head_is_embedding"], f"rank {rank}"
        assert result["expert_fraction"] == pytest.approx(1 / ep)
        if ep > 1:  # the rest of the model is whole on every EP rank
            assert result["weight_fraction"] == pytest.approx(1 - result["expert_share"] * (1 - 1 / ep))
        else:  # attention, MLPs and the vocabulary split; experts, norms, router, low-rank projections whole
            assert result["weight_fraction"] < 0.8


def test_a_file_only_a_worker_reads_is_named_by_rank_0_in_one_line(checkpoints):
    """Rank 0 loads its shard fine; rank 1 meets a broken file of its experts. The command ends with
    one line naming the rank and the file (not a traceback, nor a dead worker at the first step)."""
    done = subprocess.run([sys.executable, "-m", "deltamoe", "generate", str(checkpoints / "broken"), "-p", "1 2 3",
                           "--max-tokens", "2", "--ep", "2", "--no-compile"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "worker rank 1" in lines[0] and "broken/model-" in lines[0] and "cannot read" in lines[0]
