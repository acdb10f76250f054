"""A P/D role over worker ranks: rank 0's transfer engine moves one copy, rank 0 and the ranks share it.

Every rank holds the latent and indexer pages whole (replicated); the KDA recurrent + conv slots are
whole with `--ep` alone and split by heads with `--tp`. One copy of a request travels on the wire,
in the one-process layout (whole heads), so any prefill side pairs with any decode side. The
connector registers rank 0's `hand_off_pools`: with `--ep` rank 0's cache itself; with `--tp` rank
0's pages plus a landing area of whole-head state slots (`HandOffPools`, one per state slot).
- prefill side: the connector pushes from those pools as on one process. With `--tp`, the step that
  finishes a request's prompt also gathers every rank's heads of its state slot into the landing
  slot (`gather_heads`), before the request finishes and its push starts.
- decode side: the connector receives into those pools. With the step that first runs a handed-off
  request, rank 0 packs the request's rows and whole state slot (`packing.pack`) and broadcasts
  them over the replica's group right after that step's message; each rank (rank 0 too, under
  `--tp`) scatters the rows into its pages and keeps its own heads of the state (`take_heads`),
  after replaying the step's state-slot writes and before the forward.
Both are planned with the step (`RankZeroHandOffs.plan`, host data only) and done when it runs
(`pack`, `after_forward`): at once on one step at a time; on the device thread, while the host schedules
the next step, under one-step-ahead scheduling (`executor/overlap.py`).
Receiving or sending one copy per rank over the transfer engine would need a transport, a
registration and a descriptor per rank, and the other side would have to split or join the state
by heads for each; the collectives run over links the replica already has and leave the router,
the descriptor and the peer unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.engine.state_storage import slot_major
from deltamoe.serve.kv_transfer.mooncake_connector import PushTo, RemotePrefill
from deltamoe.serve.kv_transfer.packing import message_bytes, pack, token_rows, unpack


@dataclass
class HandOffPools:
    """The pools a connector sees in place of a `--tp` rank's cache: the rank's pages (replicated, shared
    with the cache) and whole-head state slots [layers, slots, ...] in the one-process layout (slot-major,
    as a cache's: `state_storage.py`)."""

    block_size: int
    latent: torch.Tensor
    index_keys: torch.Tensor
    latent_scale: torch.Tensor | None
    index_key_scale: torch.Tensor | None
    recurrent: torch.Tensor
    conv: torch.Tensor


def whole_head_pools(cache: HybridCache, tp: int, slots: int) -> HandOffPools:
    """`cache`'s pages with `slots` whole-head state slots (zeroed) beside them."""
    layers, _, heads, k, v = cache.recurrent.shape
    width, channels = cache.conv.shape[2:]  # [W-1, 3P]: channels last
    return HandOffPools(cache.block_size, cache.latent, cache.index_keys, cache.latent_scale, cache.index_key_scale,
                        slot_major(layers, slots, (heads * tp, k, v), cache.recurrent.dtype, cache.recurrent.device),
                        slot_major(layers, slots, (width, channels * tp), cache.conv.dtype, cache.conv.device))


def hand_off_pools(cache: HybridCache, tp: int) -> HybridCache | HandOffPools:
    """What rank 0's connector registers: the cache itself, or with `--tp` its pages and a whole-head
    landing slot for every state slot of the cache (tp x the cache's state memory, on rank 0)."""
    return cache if tp == 1 else whole_head_pools(cache, tp, cache.recurrent.shape[1])


def take_heads(cache: HybridCache, slot: int, recurrent: torch.Tensor, conv: torch.Tensor, tp_rank: int,
               tp: int) -> None:
    """Keep this rank's heads of whole-head states (recurrent [layers, H, K, V], conv [layers, W-1, 3P],
    whose channels are q, k, v of every head) in `slot`: contiguous heads per rank, as the TP plan splits them."""
    heads = cache.recurrent.shape[2]
    cache.recurrent[:, slot] = recurrent[:, tp_rank * heads:(tp_rank + 1) * heads]
    per = cache.conv.shape[3] // 3  # this rank's channels of each of q, k, v
    cache.conv[:, slot] = conv.unflatten(2, (3, tp * per))[..., tp_rank * per:(tp_rank + 1) * per].flatten(2, 3)


def first_step_after_load(seq: Sequence) -> bool:
    """The step that runs a handed-off request's last prompt token: its N-1 tokens were loaded (not
    recomputed after a preemption) and nothing has run on it since."""
    hand_off = seq.kv_transfer
    return (isinstance(hand_off, RemotePrefill) and hand_off.loaded and not seq.num_preemptions
            and seq.num_computed == seq.num_prompt_tokens - 1)


@dataclass
class LoadingCache:
    """A request the step runs first after its load: where its rows and state slot are in rank 0's pools
    (taken when the step is planned: its block table may grow while an earlier step still runs)."""

    blocks: list[int]  # the blocks holding tokens [0, num_tokens), in order
    num_tokens: int
    slot: int


@dataclass
class LoadedCache(LoadingCache):
    """A request whose cache reached rank 0 from a prefill server: where the other ranks put it.
    Its packed bytes (`nbytes`) follow the step's message as a uint8 tensor broadcast."""

    nbytes: int


@dataclass
class StepHandOffs:
    """A step's hand-off work over worker ranks, planned with the step (host data only)."""

    loading: list[LoadingCache]  # decode side: caches the other ranks lack, sent before the forward
    gather_slots: list[int]  # prefill side over --tp: state slots gathered whole to rank 0 after it


def loading_caches(cache: HybridCache, batch: ScheduledBatch) -> list[LoadingCache]:
    """Rank 0, when a step is planned: the requests of `batch` whose loaded cache the other ranks lack."""
    return [LoadingCache(seq.block_table[:-(-seq.num_computed // cache.block_size)], seq.num_computed, seq.slot)
            for seq, _ in batch.items if first_step_after_load(seq)]


def loaded_caches(cache: HybridCache, pools: HybridCache | HandOffPools, tp: int,
                  loading: list[LoadingCache]) -> tuple[list[LoadedCache], list[torch.Tensor]]:
    """Rank 0, right before the step runs: the packed bytes of `loading` (from `pools`, where the
    connector put them); under `--tp` rank 0 keeps its own heads first."""
    described, messages = [], []
    device = cache.latent.device
    for item in loading:
        rows = token_rows(item.blocks, 0, item.num_tokens, cache.block_size).to(device)
        message = torch.empty(message_bytes(pools, len(rows)), dtype=torch.uint8, device=device)
        pack(pools, rows, item.slot, message)
        if pools is not cache:
            take_heads(cache, item.slot, pools.recurrent[:, item.slot], pools.conv[:, item.slot], 0, tp)
        described.append(LoadedCache(item.blocks, item.num_tokens, item.slot, message.numel()))
        messages.append(message)
    return described, messages


def receive_loaded_caches(cache: HybridCache, loaded: list[LoadedCache], device: torch.device | str,
                          tp_rank: int, tp: int) -> None:
    """A rank > 0: take each loaded request's bytes from rank 0 and scatter them into this cache."""
    landing = cache if tp == 1 else whole_head_pools(cache, tp, 1)
    for item in loaded:
        message = torch.empty(item.nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(message, src=0)
        rows = token_rows(item.blocks, 0, item.num_tokens, cache.block_size).to(device)
        if landing is cache:
            unpack(cache, rows, item.slot, message)
        else:  # pages straight into this rank's pools, the whole-head state into slot 0 of the landing area
            unpack(landing, rows, 0, message)
            take_heads(cache, item.slot, landing.recurrent[:, 0], landing.conv[:, 0], tp_rank, tp)


def pushed_slots(batch: ScheduledBatch) -> list[int]:
    """Prefill side: the state slots of the requests whose prompt this step finishes (their push starts
    once the step is done), so that their whole-head state is gathered to rank 0 after the forward."""
    return [seq.slot for seq, n in batch.items
            if isinstance(seq.kv_transfer, PushTo) and seq.num_computed + n == len(seq.token_ids)]


def heads_of(cache: HybridCache, slots: list[int]) -> torch.Tensor:
    """This rank's recurrent and conv state of `slots`, flattened into one tensor (the gather's unit)."""
    return torch.cat([cache.recurrent[:, slots].flatten(), cache.conv[:, slots].to(cache.recurrent.dtype).flatten()])


def send_heads(cache: HybridCache, slots: list[int]) -> None:
    """A rank > 0 on a prefill side: its heads of `slots`, to rank 0's `gather_heads`."""
    dist.gather(heads_of(cache, slots), None, dst=0)


def gather_heads(cache: HybridCache, pools: HandOffPools, slots: list[int], tp: int) -> None:
    """Rank 0 on a prefill side: every rank's heads of `slots` into the whole-head landing slots that
    the connector pushes from. Ranks 0..tp-1 are the TP group of expert group 0 (the mesh orders ranks
    expert-major), which holds every head once."""
    mine = heads_of(cache, slots)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.gather(mine, parts, dst=0)
    split = cache.recurrent[:, slots].numel()
    recurrent = [part[:split].view(cache.recurrent[:, slots].shape) for part in parts[:tp]]
    conv = [part[split:].view(cache.conv[:, slots].shape).to(cache.conv.dtype) for part in parts[:tp]]
    pools.recurrent[:, slots] = torch.cat(recurrent, dim=2)  # [layers, slots, heads, K, V]: heads in rank order
    per = cache.conv.shape[3] // 3  # [layers, slots, W-1, 3P]: q, k, v channels, each in rank order
    pools.conv[:, slots] = torch.cat([c.unflatten(3, (3, per)) for c in conv], dim=4).flatten(3, 4)


class RankZeroHandOffs:
    """Rank 0's part of a role's hand-offs over worker ranks (`MultiprocExecutor.hand_off`). A step's part
    is planned with the step (`plan`, on the host) and carried out when it runs (`pack`, `after_forward`),
    which under one-step-ahead scheduling (`executor/overlap.py`) is later, on the device thread."""

    def __init__(self, cache: HybridCache, pools: HybridCache | HandOffPools, tp: int):
        self.cache, self.pools, self.tp = cache, pools, tp

    def plan(self, batch: ScheduledBatch) -> StepHandOffs:
        return StepHandOffs(loading_caches(self.cache, batch),
                            pushed_slots(batch) if self.pools is not self.cache else [])

    def pack(self, step: StepHandOffs) -> tuple[list[LoadedCache], list[torch.Tensor]]:
        """(handed-off caches the ranks lack, their bytes), read from the pools the loads landed in."""
        return loaded_caches(self.cache, self.pools, self.tp, step.loading)

    def after_forward(self, slots: list[int]) -> None:
        if slots:
            gather_heads(self.cache, self.pools, slots, self.tp)
