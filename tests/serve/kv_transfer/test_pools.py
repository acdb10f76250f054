"""Hand-off segments: tokens up to num_tokens of every latent / indexer layer (runs of blocks
consecutive on both sides merged), one state slot per KDA layer, nothing else."""

from __future__ import annotations

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.kv_transfer.pools import POOLS, PoolDescriptor, _runs, request_segments


def test_runs_merge_blocks_consecutive_on_both_sides_only():
    assert _runs([0, 1, 2, 5], [3, 4, 5, 6], [4, 4, 4, 3], 4) == [(0, 3, 12), (5, 6, 3)]
    assert _runs([0, 1], [3, 7], [4, 4], 4) == [(0, 3, 4), (1, 7, 4)]


def test_segments_cover_exactly_the_tokens_and_the_state(helpers):
    config = helpers.k31_tiny()
    cache = HybridCache(config, EngineConfig(cache_memory="2MiB", block_size=4), 256)
    remote = PoolDescriptor("peer:1", {name: 10**9 * (i + 1) for i, name in enumerate(POOLS)}, "sig")
    segments = request_segments(cache, remote, [0, 1, 2, 5], [3, 4, 5, 6], num_tokens=15, first_block=0,
                                src_slot=1, dst_slot=2)
    layout = cache.layout
    assert sum(s.nbytes for s in segments) == 15 * layout.bytes_per_token + layout.bytes_per_state_slot
    n_paged = len(layout.latent_layers) + len(layout.index_layers)
    assert len(segments) == 2 * n_paged + 2 * len(layout.kda_layers)
    row = cache.latent.stride(1) * cache.latent.element_size()
    first = segments[0]  # latent layer 0, blocks 0-2 -> 3-5
    assert (first.src, first.dst, first.nbytes) == (cache.latent.data_ptr(), remote.addresses["latent"] + 12 * row,
                                                    12 * row)
    slot = cache.recurrent.stride(1) * cache.recurrent.element_size()
    kda = segments[2 * n_paged]  # recurrent state of KDA layer 0, slot 1 -> 2
    assert (kda.src, kda.dst, kda.nbytes) == (cache.recurrent.data_ptr() + slot, remote.addresses["recurrent"] + 2 * slot,
                                              slot)
