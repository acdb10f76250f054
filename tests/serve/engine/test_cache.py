"""Cache accounting: blocks, chained hashes, state slots and snapshot retention, budget sizing, page layout."""

from __future__ import annotations

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.errors import ConfigError
from deltamoe.serve.engine.block_manager import BlockManager, chain_hash
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.cache_layout import CacheLayout, plan_capacity
from deltamoe.serve.engine.config import EngineConfig, parse_bytes
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.engine.state_pool import StatePool


def test_chain_hash_depends_on_the_whole_prefix():
    a = chain_hash(None, [1, 2, 3])
    assert a == chain_hash(None, [1, 2, 3])  # stable (not Python's salted hash)
    assert chain_hash(a, [4]) != chain_hash(chain_hash(None, [9, 2, 3]), [4])
    assert chain_hash(None, [1, 2]) != chain_hash(None, [2, 1])


def test_blocks_refcount_and_lru_reuse():
    evicted = []
    bm = BlockManager(3, block_size=2, on_evict=evicted.append)
    a, b = bm.allocate(), bm.allocate()
    assert (bm.num_free, bm.num_used) == (1, 2)
    bm.register(a, 111, [1, 2])
    assert bm.lookup(111, [1, 2]) == a and bm.lookup(111, [1, 3]) is None  # collision is no hit
    bm.ref(a)
    bm.release(a)
    assert bm.num_free == 1  # still one reference
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 3 and bm.lookup(111, [1, 2]) == a  # freed but still cached
    bm.ref(a)  # a prefix hit revives it
    assert bm.num_free == 2
    bm.release(a)
    # Free order now: the never-used block 2, then b, then a: a (cached) is evicted last.
    assert [bm.allocate() for _ in range(3)] == [2, b, a]
    assert evicted == [111] and bm.lookup(111, [1, 2]) is None


def test_snapshot_retention_cap_and_running_priority():
    pool = StatePool(num_slots=4, max_snapshots=2)
    run = pool.allocate()
    s1, s2 = pool.slot_for_snapshot(1), pool.slot_for_snapshot(2)
    assert None not in (s1, s2) and len({run, s1, s2}) == 3
    assert pool.slot_for_snapshot(1) is None  # already held
    pool.lookup(1)  # touch: 2 is now least recently used
    s3 = pool.slot_for_snapshot(3)  # cap 2: evicts 2 and reuses its slot
    assert s3 == s2 and set(pool.snapshots) == {1, 3}
    assert pool.num_available == 3
    got = [pool.allocate() for _ in range(3)]  # running sequences take the free slot, then snapshots
    assert None not in got and pool.allocate() is None and not pool.snapshots
    pool.drop(99)  # unknown hash: nothing happens
    pool.free(got[0])
    assert pool.num_available == 1


def test_budget_becomes_blocks_and_slots():
    cfg = load_preset("tiny")
    layout = CacheLayout.from_config(cfg, block_size=16)
    # tiny: 2 DSA layers x (32 + 16 latent + 16 index) fp32 = 512 B/token; 6 KDA layers x (4*32*32*4 + 384*3*4)
    assert layout.bytes_per_token == 2 * (32 + 16 + 16) * 4
    assert layout.bytes_per_state_slot == 6 * (4 * 32 * 32 * 4 + 384 * 3 * 4)
    cap = plan_capacity(layout, budget=2 * 2**20, wanted_slots=100, max_state_fraction=0.5, max_blocks=10**6)
    assert cap.num_state_slots == (2**20) // layout.bytes_per_state_slot
    assert cap.num_blocks == (2 * 2**20 - cap.num_state_slots * layout.bytes_per_state_slot) // layout.bytes_per_block
    with pytest.raises(ConfigError) as e:
        plan_capacity(layout, budget=1000, wanted_slots=1, max_state_fraction=0.5, max_blocks=10)
    assert e.value.field == "cache_memory"
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("1.5MB") == 1_500_000 and parse_bytes(4096) == 4096
    with pytest.raises(ConfigError):
        parse_bytes("lots")


def test_hybrid_cache_tensors_match_the_layout():
    cfg = load_preset("tiny")
    cache = HybridCache(cfg, EngineConfig(cache_memory="4MiB", max_num_seqs=4), max_model_len=256)
    nb, ns = cache.capacity.num_blocks, cache.capacity.num_state_slots
    assert cache.latent.shape == (2, nb * 16, 48) and cache.index_keys.shape == (2, nb * 16, 16)
    assert cache.recurrent.shape == (6, ns, 4, 32, 32) and cache.recurrent.dtype == torch.float32
    assert cache.conv.shape == (6, ns, 3, 384)  # channels last
    used = sum(t.numel() * t.element_size() for t in (cache.latent, cache.index_keys, cache.recurrent, cache.conv))
    assert used <= 4 * 2**20
    assert nb <= 4 * 256 // 16  # never more blocks than max_num_seqs sequences can use


def make_seq(tokens: list[int]) -> Sequence:
    from deltamoe.serve.engine.detokenizer import IncrementalDetokenizer
    from deltamoe.tokenizers.byte import ByteTokenizer

    return Sequence("r", list(tokens), len(tokens), SamplingParams(), torch.Generator(),
                    IncrementalDetokenizer(ByteTokenizer()), max_tokens=4, stop_ids=frozenset())


def test_prefix_match_needs_blocks_and_a_snapshot():
    cfg = load_preset("tiny")
    cache = HybridCache(cfg, EngineConfig(cache_memory="4MiB", max_num_seqs=4, block_size=4, snapshot_interval_blocks=2),
                        max_model_len=64)
    a = make_seq(list(range(20)))
    assert cache.admit(a) and a.num_computed == 0
    assert cache.next_snapshot_boundary(a, 0, 19) == 8  # every 2 blocks of 4
    assert cache.next_snapshot_boundary(a, 16, 19) == 19
    assert cache.grow(a, 19)
    assert len(a.block_table) == 5
    for n in (8, 16, 19):  # pretend the forwards ran: commit at each chunk end
        a.num_computed = n
        cache.commit(a)
    assert len(cache.slots.snapshots) == 2  # at 8 and at 16 (16 is also the prompt's last full block)
    b = make_seq(list(range(12)) + [99, 98, 97])  # shares 3 blocks; snapshots at 8 only
    assert cache.admit(b) and b.num_computed == b.num_cached_tokens == 8
    assert b.block_table == a.block_table[:2]
    assert cache.blocks.ref_counts[a.block_table[0]] == 2
    cache.free(a)
    cache.free(b)
    assert cache.blocks.num_used == 0 and cache.slots.num_running == 0
    c = make_seq(list(range(16)))  # a hit must leave one token to compute: 16 tokens -> at most 8
    assert cache.admit(c) and c.num_computed == 8


def test_latent_rows_read_only_the_asked_positions_from_scattered_pages():
    """DSA decode reads its top-k latents through `latent_rows`: on blocks scattered over the pool
    (a long-running server) they must be the same rows the full gather returns."""
    from deltamoe.serve.engine.cache_view import PagedBatchView

    cfg = load_preset("tiny")
    cache = HybridCache(cfg, EngineConfig(cache_memory="4MiB", max_num_seqs=4, block_size=4), max_model_len=256)
    layer = next(iter(cache.latent_index))
    tables = [[7, 2, 9, 0], [5, 11, 3]]  # neither row's blocks are consecutive
    past, new = [13, 9], [1, 2]
    gen = torch.Generator().manual_seed(0)
    view = PagedBatchView(cache, tables, past, slots=[0, 1], num_new_tokens=new)
    # Fill every page row, then append the new tokens through the view.
    cache.latent.copy_(torch.randn(cache.latent.shape, generator=gen))
    full = view.append_latent(layer, torch.randn(2, 2, cache.latent.shape[-1], generator=gen))  # [2, S, D]
    positions = torch.tensor([[0, 13, 5, 4, 12], [10, 1, 8, 3, 0]])  # row 0's past+new = 14, row 1's = 11
    got = view.latent_rows(layer, positions)
    assert torch.equal(got, full.gather(1, positions[..., None].expand(-1, -1, full.shape[-1])))
    # Stored-only tokens are readable too: row 1's second new token sits at position 10.
    store_view = PagedBatchView(cache, tables, past, slots=[0, 1], num_new_tokens=new)
    fresh = torch.randn(2, 2, cache.latent.shape[-1], generator=gen)
    store_view.store_latent(layer, fresh)
    assert torch.equal(store_view.latent_rows(layer, torch.tensor([[13], [10]]))[:, 0], torch.stack([fresh[0, 0], fresh[1, 1]]))


def test_next_decode_view_is_the_view_built_for_the_next_step():
    """A multi-step window continues its step's cache view (`next_decode_view`) instead of building one
    from the host lists: after a step's `advance` it must be the view built for the next step, page
    rows written and read included, and it refuses what it cannot continue."""
    from deltamoe.serve.engine.cache_view import PagedBatchView

    cache = HybridCache(load_preset("tiny"), EngineConfig(cache_memory="4MiB", max_num_seqs=4, block_size=4),
                        max_model_len=256)
    tables, past = [[7, 2, 9], [5, 11, 3]], [5, 9]  # room for two more tokens in row 1, the longer
    view = PagedBatchView(cache, tables, past, slots=[0, 1], num_new_tokens=1, slice_consecutive=False)
    for step in range(1, 3):
        view._write, view._read  # built for this step, then the forward advances the view
        view.advance(1)
        view = view.next_decode_view()
        built = PagedBatchView(cache, tables, [p + step for p in past], slots=[0, 1], num_new_tokens=1,
                               slice_consecutive=False)
        for name in ("past_lengths", "_table", "_slots", "_write", "_read"):
            assert torch.equal(getattr(view, name), getattr(built, name)), (step, name)
        assert view._total == built._total and not view._fresh
    view.advance(1)
    with pytest.raises(ValueError, match="block tables"):  # position 12 needs a fourth block
        view.next_decode_view()
    sliced = PagedBatchView(cache, [[4, 5]], [3], slots=[0], num_new_tokens=1)
    with pytest.raises(ValueError, match="gathers its pages"):
        sliced.next_decode_view()
    with pytest.raises(ValueError, match="decode view"):
        PagedBatchView(cache, tables, past, slots=[0, 1], num_new_tokens=[1, 2]).next_decode_view()
