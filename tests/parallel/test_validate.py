"""Bad layouts fail with a ConfigError naming the field, before any process group exists."""

import pytest
import torch.distributed as dist

from deltamoe.config import load_preset
from deltamoe.errors import ConfigError
from deltamoe.parallel import ParallelDims, init_distributed

TINY = load_preset("tiny")  # 8 layers in 2 AttnRes blocks of 4, 16 experts, 4 KDA and 4 MLA heads


@pytest.mark.parametrize("dims, world, field, message", [
    (ParallelDims(dp=2, ep=3), 2, "ep", "expected a divisor of num_experts (16), got 3"),
    (ParallelDims(dp=2, ep=4), 2, "ep", "expected a divisor of dp (2)"),
    (ParallelDims(pp=3), 3, "pp", "3 pipeline stages need at least as many AttnRes blocks; the model has 2"),
    (ParallelDims(pp=2, schedule="interleaved1f1b", stages_per_rank=2, microbatches=2), 2, "pp",
     "4 pipeline stages"),
    (ParallelDims(dp=2, tp=2), 2, "world_size", "dp * tp * pp = 2 * 2 * 1 = 4 ranks, but the world has 2"),
    (ParallelDims(tp=3), 3, "tp", "tp = 3 must divide kda_num_heads (4)"),
    (ParallelDims(pp=2, schedule="gpipe"), 2, "schedule", "expected one of ('1f1b', 'interleaved1f1b')"),
    (ParallelDims(pp=2, stages_per_rank=2), 2, "stages_per_rank", "expected 1 for schedule '1f1b'"),
    (ParallelDims(pp=2, schedule="interleaved1f1b", microbatches=3), 2, "microbatches", "a multiple of pp (2)"),
    (ParallelDims(dp=0), 0, "dp", "expected a positive integer"),
    # torch's 1F1B raised "Number of microbatches (1) must be >= ..." at step 1
    (ParallelDims(pp=2), 2, "microbatches", "expected at least pp (2) microbatches for a pipeline, got 1"),
    # more stages than ranks is not a question of inferring dp
    (ParallelDims(pp=16, microbatches=16), 2, "pp", "tp * pp = 1 * 16 = 16 ranks are needed for one model copy"),
])
def test_bad_layouts_name_the_field(dims, world, field, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")) as e:
        dims.resolve(TINY, world)
    assert e.value.field == field
    assert not dist.is_initialized()


def test_tied_embeddings_cannot_be_pipelined():
    with pytest.raises(ConfigError) as e:
        ParallelDims(pp=2).resolve(TINY.replace(tie_word_embeddings=True), 2)
    assert e.value.field == "tie_word_embeddings"


def test_ep_needs_routed_experts():
    with pytest.raises(ConfigError, match="without routed experts"):
        ParallelDims(dp=2, ep=2).resolve(TINY.replace(num_experts=0), 2)


def test_valid_layouts_pass():
    ParallelDims(dp=2, ep=2, tp=2, pp=2, microbatches=2).resolve(TINY, 8)
    ParallelDims(pp=2, schedule="interleaved1f1b", stages_per_rank=2, microbatches=4).resolve(
        load_preset("kimi-k3"), 2)
    assert ParallelDims(dp=4, ep=4, tp=2, pp=8).world_size() == 64  # ep does not add ranks


def test_dp_is_inferred_from_the_world():
    assert ParallelDims(tp=2, pp=2, microbatches=2).resolve(TINY, 8).dp == 2
    assert ParallelDims(ep=2).resolve(TINY, 4).dp == 4
    assert ParallelDims(dp=2).resolve(TINY, 2).dp == 2  # given: kept
    with pytest.raises(ConfigError, match="not a multiple of tp \\* pp = 2") as e:
        ParallelDims(tp=2).resolve(TINY, 3)
    assert e.value.field == "dp"


def test_single_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(ParallelDims().resolve(TINY, 1)) is None
    assert not dist.is_initialized()


def test_the_cli_module_and_the_layout_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, deltamoe.train.cli, deltamoe.parallel.dims; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_ep_alone_under_two_processes():
    """`torchrun --nproc-per-node 2 -m deltamoe train --ep 2`: dp is inferred (2) and the EP group fits inside it."""
    from deltamoe.train.config import TrainConfig

    cfg = TrainConfig.from_dict({"parallel": {"ep": 2}}).validate(world_size=2)
    assert (cfg.parallel.dp, cfg.parallel.ep) == (2, 2)
    cfg.parallel.check_layout(TINY, 2)
