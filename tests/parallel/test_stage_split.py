"""The pipeline split follows AttnRes blocks (spec §3) and never cuts one."""

import pytest

from deltamoe.config import load_preset
from deltamoe.errors import ConfigError
from deltamoe.parallel.stage_split import split_stages, split_units


def test_k3_eight_stages_is_twelve_times_seven_plus_nine():
    stages = split_stages(load_preset("kimi-k3"), 8)
    assert [len(s) for s in stages] == [12] * 7 + [9]
    assert [s.start for s in stages] == [0, 12, 24, 36, 48, 60, 72, 84]


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_k3_split_never_cuts_a_block(num_stages):
    config = load_preset("kimi-k3")
    stages = split_stages(config, num_stages)
    assert stages[0].start == 0 and stages[-1].stop == config.num_hidden_layers
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))  # contiguous, no gap, no overlap
    assert all(s.start % config.attn_res_block_size == 0 for s in stages)  # every stage starts a block
    blocks = [-(-len(s) // config.attn_res_block_size) for s in stages]
    assert max(blocks) - min(blocks) <= 1  # as even as whole blocks allow
    assert blocks == sorted(blocks, reverse=True)  # extra blocks go to the early stages


def test_uneven_block_counts_go_to_the_early_stages():
    assert [len(s) for s in split_stages(load_preset("kimi-k3"), 3)] == [36, 36, 21]


def test_without_attn_res_the_unit_is_a_layer():
    config = load_preset("kimi-linear-48b")
    assert config.attn_res_block_size is None
    assert len(split_units(config)) == config.num_hidden_layers
    stages = split_stages(config, 4)
    assert sum(len(s) for s in stages) == config.num_hidden_layers
    assert max(len(s) for s in stages) - min(len(s) for s in stages) <= 1


def test_more_stages_than_blocks_is_a_config_error():
    config = load_preset("kimi-k3")  # 8 blocks
    message = "9 pipeline stages need at least as many AttnRes blocks; the model has 8"
    with pytest.raises(ConfigError, match=message) as e:
        split_stages(config, 9)
    assert e.value.field == "pp"
