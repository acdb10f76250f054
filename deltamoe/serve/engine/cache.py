"""HybridCache: the engine's memory. Paged latent-KV and indexer-key blocks, KDA state slots, prefix reuse.

Tensors (allocated once from the byte budget):
- latent pages  [n_latent_layers, num_blocks * block_size, kv_lora + rope]
- index pages   [n_dsa_layers,    num_blocks * block_size, index_head_dim]
  (`kv_cache_dtype="fp8"`: e4m3 pages plus fp32 scales per tile of each row, `latent_scale` /
  `index_key_scale`: about half the bytes of bf16 pages)
- recurrent     [n_kda_layers, num_slots, H, K, V] fp32 and conv [n_kda_layers, num_slots, W-1, 3P]
  (slot-major, `state_storage.py`: a slot's recurrent state of every layer is one run, so is its conv)

Prefix caching needs two things at a block boundary: the latent/index blocks up to it (hash
chain, `BlockManager`) and the KDA state there (a snapshot slot, `StatePool`). A recurrent state
cannot be rebuilt from blocks, so snapshots are taken when a sequence's computed length lands on
a boundary that the retention policy keeps: every `snapshot_interval_blocks` blocks, and the last
full block of each prompt (where a follow-up turn most likely diverges). The scheduler cuts
prefill chunks at those boundaries (`next_snapshot_boundary`).

With tensor-parallel workers (`serve/executor/`) each rank holds the KDA state of its own heads
(`tp_size`); the latent and indexer pages are replicated. Rank 0 owns the bookkeeping and logs every
state-slot write it makes outside a forward (zeroing a slot, copying a snapshot) in `state_log`, so
that the other ranks replay them on their shards (`apply_state_ops`) before the next forward.

Memory only: which sequence runs, and when, is the scheduler's business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deltamoe.config import ModelConfig
from deltamoe.serve.engine.block_manager import BlockManager, chain_hash
from deltamoe.ops.quant import FP8_DTYPE
from deltamoe.serve.engine.cache_layout import CacheCapacity, CacheLayout, fp8_tile, plan_capacity
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.engine.state_pool import StatePool
from deltamoe.serve.engine.state_storage import slot_major


class HybridCache:
    @staticmethod
    def plan(model_config: ModelConfig, config: EngineConfig, max_model_len: int, dtype: torch.dtype = torch.float32,
             tp_size: int = 1) -> tuple[CacheLayout, CacheCapacity]:
        """The layout and the blocks / state slots `config.cache_memory` holds, allocating nothing (a
        ConfigError when it cannot hold one of each): what a replica checks before it starts its ranks."""
        layout = CacheLayout.from_config(model_config, config.block_size, dtype, tp_size,
                                         config.kv_cache_dtype == "fp8", mtp_layers=1 if config.speculative else 0)
        max_blocks = config.max_num_seqs * -(-max_model_len // config.block_size)  # never more than all can use
        want_slots = config.max_num_seqs + (config.max_snapshots or 0)
        return layout, plan_capacity(layout, int(config.cache_memory), want_slots, config.max_state_fraction,
                                     max_blocks)

    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_model_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", tp_size: int = 1):
        self.config = config
        kv_fp8 = config.kv_cache_dtype == "fp8"
        self.layout, self.capacity = self.plan(model_config, config, max_model_len, dtype, tp_size)
        layout = self.layout
        self.block_size = bs = config.block_size
        nb, ns = self.capacity.num_blocks, self.capacity.num_state_slots
        self.latent_index = {layer: i for i, layer in enumerate(layout.latent_layers)}
        self.index_key_index = {layer: i for i, layer in enumerate(layout.index_layers)}
        self.kda_index = {layer: i for i, layer in enumerate(layout.kda_layers)}
        page_dtype = FP8_DTYPE if kv_fp8 else dtype
        self.latent = torch.zeros(len(layout.latent_layers), nb * bs, layout.latent_dim, dtype=page_dtype, device=device)
        self.index_keys = torch.zeros(len(layout.index_layers), nb * bs, layout.index_dim, dtype=page_dtype,
                                      device=device)
        # fp8 pages: the fp32 scale of each `fp8_tile` values of each row (None otherwise).
        self.latent_scale = self.index_key_scale = None
        if kv_fp8:
            self.latent_scale = torch.zeros(*self.latent.shape[:2], layout.latent_dim // fp8_tile(layout.latent_dim),
                                            device=device)
            self.index_key_scale = torch.zeros(*self.index_keys.shape[:2], layout.index_dim // fp8_tile(layout.index_dim),
                                               device=device)
        self.recurrent = slot_major(len(layout.kda_layers), ns, layout.recurrent_shape, torch.float32, device)
        self.conv = slot_major(len(layout.kda_layers), ns, layout.conv_shape, dtype, device)
        max_snapshots = min(config.max_snapshots or 0, ns - 1) if layout.kda_layers else 0
        self.slots = StatePool(ns, max_snapshots)
        self.blocks = BlockManager(nb, bs, on_evict=self.slots.drop)
        self.prefix_caching = config.enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of which served from the cache
        # (src, dst) state-slot writes since the last `take_state_ops` (src None: zero dst), when
        # other ranks mirror this cache; None: not logged.
        self.state_log: list[tuple[int | None, int]] | None = None
        # True: those writes are only logged, and the thread that runs the forwards replays them in
        # order before the next one (`executor/overlap.py`: a forward may still be running).
        self.defer_state_writes = False

    # ------------------------------------------------------------------ capacity questions
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have a home."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def max_tokens_per_sequence(self) -> int:
        return self.blocks.num_blocks * self.block_size

    # ------------------------------------------------------------------ per-sequence memory
    def admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence a state slot and whatever prefix the cache already holds; False if no slot.

        The caller grows the sequence for its first chunk next and `free`s it if that fails, then
        `record_admission` once it is really running (so hit statistics count each admission once).
        """
        hit_blocks, snapshot = self._match_prefix(seq)
        slot = self.slots.allocate()  # may evict the matched snapshot; its data stays intact until copied
        if slot is None:
            return False
        seq.slot = slot
        if snapshot is None:
            self._zero_state(slot)
        elif snapshot != slot:
            self._copy_state(snapshot, slot)
        for block in hit_blocks:
            self.blocks.ref(block)
        seq.block_table = list(hit_blocks)
        seq.num_computed = seq.num_cached_tokens = len(hit_blocks) * self.block_size
        return True

    def record_admission(self, seq: Sequence) -> None:
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += min(seq.num_cached_tokens, seq.num_prompt_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate blocks so `seq` can hold `num_tokens` tokens; all or nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate() for _ in range(need))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """`child` continues from `parent`'s computed tokens: full blocks shared by reference, the
        partial last block copied, the KDA state copied into a slot of its own; False (nothing
        taken) if no slot or block is free (`forks.py`)."""
        n, bs = parent.num_computed, self.block_size
        full, partial = divmod(n, bs)
        if partial and self.blocks.num_free < 1:
            return False
        child.slot = self.slots.allocate()
        if child.slot is None:
            return False
        self._copy_state(parent.slot, child.slot)
        for block in parent.block_table[:full]:
            self.blocks.ref(block)
        child.block_table = parent.block_table[:full]
        if partial:
            block = self.blocks.allocate()
            src, dst = parent.block_table[full] * bs, block * bs
            for pages in (self.latent, self.index_keys, self.latent_scale, self.index_key_scale):
                if pages is not None:
                    pages[:, dst:dst + partial] = pages[:, src:src + partial]
            child.block_table.append(block)
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_published_blocks = min(parent.num_published_blocks, full)
        child.num_computed = child.num_cached_tokens = n
        return True

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks (full ones stay findable by hash) and its state slot."""
        for block in reversed(seq.block_table):  # tail first: the prefix head is evicted last
            self.blocks.release(block)
        seq.block_table = []
        seq.num_published_blocks = 0
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None

    def release_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of `seq` past its first `num_tokens` tokens (positions it wrote but
        did not keep, as rejected draft tokens: never published, so nothing to forget)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self.blocks.release(seq.block_table.pop())

    def commit(self, seq: Sequence, num_computed: int | None = None) -> None:
        """After a forward: publish newly full blocks, and snapshot the KDA state at a kept boundary.
        `num_computed`: the tokens that forward left computed, when `seq.num_computed` already counts
        a later step's (one-step-ahead scheduling)."""
        if not self.prefix_caching:
            return
        n = seq.num_computed if num_computed is None else num_computed
        full = min(n, len(seq.token_ids)) // self.block_size
        for i in range(seq.num_published_blocks, full):  # only blocks that filled up since the last commit
            block = seq.block_table[i]
            if self.blocks.hashes[block] is None:
                self.blocks.register(block, self._block_hash(seq, i), self._block_tokens(seq, i))
        seq.num_published_blocks = max(seq.num_published_blocks, full)
        if self.takes_snapshot(seq, n) and seq.slot is not None:
            target = self.slots.slot_for_snapshot(self._block_hash(seq, n // self.block_size - 1))
            if target is not None:
                self._copy_state(seq.slot, target)

    def takes_snapshot(self, seq: Sequence, num_computed: int) -> bool:
        """Whether `commit` after a forward that leaves `num_computed` tokens computed snapshots the KDA state."""
        return bool(num_computed and num_computed % self.block_size == 0 and self._keeps_snapshot(seq, num_computed))

    def next_snapshot_boundary(self, seq: Sequence, start: int, end: int) -> int:
        """The first kept snapshot boundary in (start, end), else end: where a prefill chunk should stop."""
        if not self.prefix_caching or not self.layout.kda_layers:
            return end
        bs = self.block_size
        for b in range((start // bs + 1) * bs, end, bs):
            if self._keeps_snapshot(seq, b):
                return b
        return end

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (its KV and KDA snapshots were computed by the old weights).
        Call it with no sequence running: a running sequence would publish its older blocks again."""
        self.blocks.forget_hashes()
        for block_hash in list(self.slots.snapshots):
            self.slots.drop(block_hash)

    @contextlib.contextmanager
    def leaving_no_trace(self) -> Iterator[None]:
        """Memory use that the cache forgets: inside, prefix caching is off (no lookups, no blocks
        published, no snapshots); on exit the prefix statistics and the order in which free blocks
        and slots are handed out are as before. Every sequence admitted inside is freed before exit.
        Meant for an idle cache (an engine's warm-up at startup): a block handed out inside loses
        whatever prefix it held."""
        saved = (self.prefix_caching, self.prefix_queries, self.prefix_hits)
        blocks, slots = self.blocks.free_order(), self.slots.free_order()
        self.prefix_caching = False
        try:
            yield
        finally:
            self.prefix_caching, self.prefix_queries, self.prefix_hits = saved
            self.blocks.restore_free_order(blocks)
            self.slots.restore_free_order(slots)

    # ------------------------------------------------------------------ stats
    @property
    def block_usage(self) -> float:
        return self.blocks.num_used / self.blocks.num_blocks

    @property
    def slot_usage(self) -> float:
        """Share of state slots held by running sequences (snapshots are evictable, not counted)."""
        return self.slots.num_running / self.slots.num_slots

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ------------------------------------------------------------------ internals
    def _keeps_snapshot(self, seq: Sequence, boundary: int) -> bool:
        k = boundary // self.block_size
        last_prompt_boundary = (seq.num_prompt_tokens // self.block_size) * self.block_size
        return k % self.config.snapshot_interval_blocks == 0 or boundary == last_prompt_boundary

    def _block_tokens(self, seq: Sequence, i: int) -> list[int]:
        tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
        # An image's placeholders count as its content hash: a different image is a different prefix.
        return tokens if seq.images is None else seq.images.cache_keys(tokens, i * self.block_size)

    def _block_hash(self, seq: Sequence, i: int) -> int:
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            seq.block_hashes.append(chain_hash(seq.block_hashes[-1] if j else None, self._block_tokens(seq, j)))
        return seq.block_hashes[i]

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], int | None]:
        """Longest run of cached full blocks that ends at a boundary with a KDA snapshot.

        At least one token is left to compute: the last prompt token's logits are needed.
        """
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:  # a hit would skip tokens to score
            return [], None
        blocks: list[int] = []
        best: tuple[int, int | None] = (0, None)
        for i in range((len(seq.token_ids) - 1) // self.block_size):
            block = self.blocks.lookup(self._block_hash(seq, i), self._block_tokens(seq, i))
            if block is None:
                break
            blocks.append(block)
            if not self.layout.kda_layers:
                best = (i + 1, None)
            elif (slot := self.slots.lookup(seq.block_hashes[i])) is not None:
                best = (i + 1, slot)
        return blocks[: best[0]], best[1]

    def take_state_ops(self) -> list[tuple[int | None, int]]:
        """The logged state-slot writes since the last call, for the other ranks to replay."""
        ops, self.state_log = self.state_log or [], [] if self.state_log is not None else None
        return ops

    def apply_state_ops(self, ops: list[tuple[int | None, int]]) -> None:
        """Replay logged state-slot writes (rank 0's on another rank, or deferred ones), in order."""
        for src, dst in ops:
            self._write_state(src, dst)

    def _zero_state(self, slot: int) -> None:
        self._state_op(None, slot)

    def _copy_state(self, src: int, dst: int) -> None:
        self._state_op(src, dst)

    def _state_op(self, src: int | None, dst: int) -> None:
        if not self.defer_state_writes:
            self._write_state(src, dst)
        if self.state_log is not None:
            self.state_log.append((src, dst))

    def _write_state(self, src: int | None, dst: int) -> None:
        """Zero slot `dst` (src None) or copy slot `src` into it."""
        if src is None:
            self.recurrent[:, dst].zero_()
            self.conv[:, dst].zero_()
        else:
            self.recurrent[:, dst] = self.recurrent[:, src]
            self.conv[:, dst] = self.conv[:, src]
