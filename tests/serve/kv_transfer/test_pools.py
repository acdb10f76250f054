"""Hand-off segments: tokens up to num_tokens of every latent / indexer layer (runs of blocks
consecutive on both sides merged), a state slot's recurrent and conv state of every KDA layer as a
run each, nothing else; the packed
message carries the same bytes and lands in exactly the receiver's rows and slot."""

from __future__ import annotations

import ctypes

import pytest
import torch

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.kv_transfer.packing import message_bytes, pack, payload_bytes, token_rows, unpack
from deltamoe.serve.engine.state_storage import slot_run_bytes
from deltamoe.serve.kv_transfer.pools import (PAGED_POOLS, POOLS, PoolDescriptor, _runs, describe, pool_tensors,
                                              request_segments)
from deltamoe.serve.kv_transfer.staging import StagingArea


def test_runs_merge_blocks_consecutive_on_both_sides_only():
    assert _runs([0, 1, 2, 5], [3, 4, 5, 6], [4, 4, 4, 3], 4) == [(0, 3, 12), (5, 6, 3)]
    assert _runs([0, 1], [3, 7], [4, 4], 4) == [(0, 3, 4), (1, 7, 4)]


def test_segments_cover_exactly_the_tokens_and_the_state(helpers):
    config = helpers.k31_tiny()
    cache = HybridCache(config, EngineConfig(cache_memory="2MiB", block_size=4), 256)
    remote = PoolDescriptor("peer:1", {name: 10**9 * (i + 1) for i, name in enumerate(POOLS)}, "sig",
                            {name: t.stride(0) * t.element_size() for name, t in pool_tensors(cache).items()})
    segments = request_segments(cache, remote, [0, 1, 2, 5], [3, 4, 5, 6], num_tokens=15, first_block=0,
                                src_slot=1, dst_slot=2)
    layout = cache.layout
    assert sum(s.nbytes for s in segments) == 15 * layout.bytes_per_token + layout.bytes_per_state_slot
    n_paged = len(layout.latent_layers) + len(layout.index_layers)
    # Here the remote recurrent and conv pools lie far apart: one segment each, every layer of the slot.
    assert len(segments) == 2 * n_paged + 2
    row = cache.latent.stride(1) * cache.latent.element_size()
    first = segments[0]  # latent layer 0, blocks 0-2 -> 3-5
    assert (first.src, first.dst, first.nbytes) == (cache.latent.data_ptr(), remote.addresses["latent"] + 12 * row,
                                                    12 * row)
    slot = slot_run_bytes(cache.recurrent)
    kda = segments[2 * n_paged]  # recurrent state of every KDA layer, slot 1 -> 2
    assert (kda.src, kda.dst, kda.nbytes) == (cache.recurrent.data_ptr() + slot, remote.addresses["recurrent"] + 2 * slot,
                                              cache.recurrent[:, 0].numel() * 4)


def test_a_state_slot_is_two_segments_between_real_caches(helpers):
    config = EngineConfig(cache_memory="2MiB", block_size=4)
    src, dst = HybridCache(helpers.k31_tiny(), config, 256), HybridCache(helpers.k31_tiny(), config, 256)
    remote = describe(dst, "peer:1", helpers.k31_tiny())  # the real addresses: segments land in dst
    segments = request_segments(src, remote, [7], [5], num_tokens=3, first_block=0, src_slot=1, dst_slot=2)
    n_paged = len(src.layout.latent_layers) + len(src.layout.index_layers)
    state = segments[n_paged:]  # recurrent, then conv, each every layer of the slot
    assert len(state) == 2 and sum(s.nbytes for s in state) == src.layout.bytes_per_state_slot
    assert [(s.src, s.dst) for s in state] == [
        (pool[0, 1].data_ptr(), remote.addresses[name] + 2 * slot_run_bytes(pool))
        for name, pool in (("recurrent", src.recurrent), ("conv", src.conv))]
    # Those bytes, copied, land in exactly slot 2's recurrent and conv state of every layer.
    for pool in (src.recurrent, src.conv):
        pool.view(torch.uint8).random_(0, 120, generator=torch.Generator().manual_seed(0))
    for s in state:
        ctypes.memmove(s.dst, s.src, s.nbytes)
    assert torch.equal(dst.recurrent[:, 2], src.recurrent[:, 1]) and torch.equal(dst.conv[:, 2], src.conv[:, 1])
    assert not dst.recurrent[:, [0, 1, 3]].any() and not dst.conv[:, [0, 1, 3]].any()



@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_direct_segments_land_in_a_cache_of_another_size(helpers, kv_cache_dtype):
    """A decode server's pools hold another number of blocks than the prefill server's (its memory, its
    state slots, its --tp split): a paged pool's layer stride differs, so every layer's rows must be
    addressed with the receiver's stride. (They were written with the sender's: layer 0 landed, the
    others in the wrong rows, or in another request's.)"""
    small = EngineConfig(cache_memory="1MiB", block_size=4, kv_cache_dtype=kv_cache_dtype)
    src = HybridCache(helpers.k31_tiny(), small, 256)
    dst = HybridCache(helpers.k31_tiny(), EngineConfig(cache_memory="2MiB", block_size=4, kv_cache_dtype=kv_cache_dtype),
                      256)
    assert dst.latent.shape[1] > src.latent.shape[1] and dst.latent.shape[0] > 1
    for pool in pool_tensors(src).values():
        pool.view(torch.uint8).random_(0, 120, generator=torch.Generator().manual_seed(0))
    before = {name: pool.clone() for name, pool in pool_tensors(dst).items()}
    segments = request_segments(src, describe(dst, "peer:1", helpers.k31_tiny()), [0, 7], [9, 3], num_tokens=7,
                                first_block=0, src_slot=1, dst_slot=2)
    for s in segments:
        ctypes.memmove(s.dst, s.src, s.nbytes)
    src_rows, dst_rows = token_rows([0, 7], 0, 7, 4).flat(), token_rows([9, 3], 0, 7, 4).flat()
    for name, pool in pool_tensors(dst).items():
        moved, old, new = pool_tensors(src)[name].view(torch.uint8), before[name].view(torch.uint8), pool.view(torch.uint8)
        if name in PAGED_POOLS:
            assert torch.equal(new[:, dst_rows], moved[:, src_rows]), name  # every layer's rows
            untouched = torch.ones(new.shape[1], dtype=torch.bool)
            untouched[dst_rows] = False
            assert torch.equal(new[:, untouched], old[:, untouched]), name
        else:
            assert torch.equal(new[:, 2], moved[:, 1]) and torch.equal(new[:, [0, 1, 3]], old[:, [0, 1, 3]]), name


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("src_blocks, dst_blocks, first_block, num_tokens", [
    ([0, 7], [1, 5], 1, 10),  # a whole block, then part of one
    ([0, 7], [1, 5], 1, 12),  # whole blocks only
    ([7], [5], 2, 9),  # part of one block only
])
def test_packed_message_moves_exactly_the_request_rows_and_slot(helpers, kv_cache_dtype, src_blocks, dst_blocks,
                                                                first_block, num_tokens):
    config = EngineConfig(cache_memory="2MiB", block_size=4, kv_cache_dtype=kv_cache_dtype)
    src, dst = HybridCache(helpers.k31_tiny(), config, 256), HybridCache(helpers.k31_tiny(), config, 256)
    for pool in pool_tensors(src).values():
        pool.view(torch.uint8).random_(0, 120, generator=torch.Generator().manual_seed(0))
    before = {name: pool.clone() for name, pool in pool_tensors(dst).items()}
    # Tokens from first_block * 4 up to num_tokens (earlier blocks not sent: the receiver holds them).
    src_rows, dst_rows = (token_rows(b, first_block, num_tokens, 4) for b in (src_blocks, dst_blocks))
    count = num_tokens - 4 * first_block
    assert dst_rows.flat().tolist() == [4 * b + i for b in dst_blocks for i in range(4)][:count]
    message = torch.zeros(message_bytes(src, len(src_rows)), dtype=torch.uint8)
    pack(src, src_rows, 1, message)
    unpack(dst, dst_rows, 2, message)
    assert payload_bytes(src, count) == count * src.layout.bytes_per_token + src.layout.bytes_per_state_slot
    for name, pool in pool_tensors(dst).items():
        moved, old, new = pool_tensors(src)[name].view(torch.uint8), before[name].view(torch.uint8), pool.view(torch.uint8)
        if name in PAGED_POOLS:
            assert torch.equal(new[:, dst_rows.flat()], moved[:, src_rows.flat()]), name
            untouched = torch.ones(new.shape[1], dtype=torch.bool)
            untouched[dst_rows.flat()] = False
            assert torch.equal(new[:, untouched], old[:, untouched]), name
        else:
            assert torch.equal(new[:, 2], moved[:, 1]) and torch.equal(new[:, [0, 1, 3]], old[:, [0, 1, 3]]), name


def test_token_rows_need_exactly_the_blocks_that_hold_them():
    assert token_rows([3, 1], 2, 13, 4).flat().tolist() == [12, 13, 14, 15, 4]
    for blocks, first_block, num_tokens in (([0, 1], 0, 4), ([0], 0, 5), ([0], 1, 4)):
        with pytest.raises(ValueError, match="blocks of 4"):
            token_rows(blocks, first_block, num_tokens, 4)


def test_staging_area_lends_aligned_ranges_and_joins_them_back():
    area = StagingArea(1024)
    a, b = area.borrow(100, 0.0), area.borrow(500, 0.0)
    assert (a, b) == (0, 128)  # 64-byte aligned
    assert area.borrow(600, 0.0) is None and not area.fits(1025)  # busy now / never fits
    area.give_back(a, 100)
    area.give_back(b, 500)
    assert area.free_bytes() == 1024 and area.borrow(1024, 0.0) == 0
