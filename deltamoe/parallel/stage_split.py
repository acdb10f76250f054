"""Pipeline stage split: contiguous layer ranges that never cut a Block AttnRes block (spec §3).

The unit of the split is an AttnRes block (`attn_res_block_size` layers; the last block may be
shorter, K3: 7 x 12 + 9) or a single layer when the model has no AttnRes. Units are dealt out
as evenly as possible; stages that get an extra unit are the early ones, because the last
stage also carries the final norm, the LM head, the loss and the MTP layers.
"""

from __future__ import annotations

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError


def split_units(config: ModelConfig) -> list[range]:
    """The indivisible layer ranges: AttnRes blocks, or single layers without AttnRes."""
    n, size = config.num_hidden_layers, config.attn_res_block_size or 1
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def split_stages(config: ModelConfig, num_stages: int) -> list[range]:
    """Layer ranges of `num_stages` pipeline stages, in order; each is a union of whole units."""
    units = split_units(config)
    if not 1 <= num_stages <= len(units):
        what = "AttnRes blocks" if config.attn_res_block_size else "layers"
        raise ConfigError(f"{num_stages} pipeline stages need at least as many {what}; the model has {len(units)}",
                          field="pp", hint="use fewer stages (pp * stages_per_rank)")
    per_stage, extra = divmod(len(units), num_stages)
    stages, first = [], 0
    for s in range(num_stages):
        count = per_stage + (1 if s < extra else 0)
        stages.append(range(units[first].start, units[first + count - 1].stop))
        first += count
    return stages
