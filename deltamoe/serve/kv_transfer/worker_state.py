"""A P/D role over `--ep` worker ranks: rank 0's cache is the one handed off, and it feeds the others.

With expert parallelism alone (tp = 1) every rank holds the whole attention state: the latent and
indexer pages and the KDA recurrent + conv slots are replicated, written by the same forward on
every rank. So one copy is enough on the wire:
- prefill side: the connector registers rank 0's pools and pushes from them, as on one process
  (rank 0's cache holds what every rank holds);
- decode side: the connector receives into rank 0's pools only, and the other ranks get the
  request's cache from rank 0 with the step that first runs it: rank 0 packs the request's rows
  and state slot (`packing.pack`) and broadcasts them over the replica's group right after that
  step's message; each rank scatters them into its own blocks and slot (`packing.unpack`) after
  replaying the step's state-slot writes and before the forward.
Receiving one copy per rank over the transfer engine would need a transport, a registration and a
descriptor per rank and a prefill side that writes each of them; the broadcast is one collective
over links the replica already has, and keeps the router, the descriptor and the prefill side
unchanged.

With tensor parallelism (tp > 1) each rank holds the KDA state of its own heads, so a hand-off
would have to split or gather the state by heads on one side: not yet (`check_hand_off_workers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.scheduler import ScheduledBatch
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.kv_transfer.mooncake_connector import RemotePrefill
from deltamoe.serve.kv_transfer.packing import message_bytes, pack, token_rows, unpack


@dataclass
class LoadedCache:
    """A request whose cache reached rank 0 from a prefill server: where the other ranks put it.
    Its packed bytes (`nbytes`) follow the step's message as a uint8 tensor broadcast."""

    rows: list[int]  # pool rows of tokens [0, num_computed), in token order
    slot: int
    nbytes: int


def first_step_after_load(seq: Sequence) -> bool:
    """The step that runs a handed-off request's last prompt token: its N-1 tokens were loaded (not
    recomputed after a preemption) and nothing has run on it since."""
    hand_off = seq.kv_transfer
    return (isinstance(hand_off, RemotePrefill) and hand_off.loaded and not seq.num_preemptions
            and seq.num_computed == seq.num_prompt_tokens - 1)


def loaded_caches(cache: HybridCache, batch: ScheduledBatch) -> tuple[list[LoadedCache], list[torch.Tensor]]:
    """Rank 0, before a step: the requests of `batch` that the other ranks lack, and their packed bytes."""
    described, messages = [], []
    for seq, _ in batch.items:
        if not first_step_after_load(seq):
            continue
        rows = token_rows(seq.block_table, 0, seq.num_computed, cache.block_size).to(cache.latent.device)
        message = torch.empty(message_bytes(cache, len(rows)), dtype=torch.uint8, device=cache.latent.device)
        pack(cache, rows, seq.slot, message)
        described.append(LoadedCache(rows.tolist(), seq.slot, message.numel()))
        messages.append(message)
    return described, messages


def receive_loaded_caches(cache: HybridCache, loaded: list[LoadedCache], device: torch.device | str) -> None:
    """A rank > 0: take each loaded request's bytes from rank 0 and scatter them into this cache."""
    for item in loaded:
        message = torch.empty(item.nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(message, src=0)
        unpack(cache, torch.tensor(item.rows, dtype=torch.long, device=device), item.slot, message)


def share_loaded_caches(executor, cache: HybridCache) -> None:
    """Have `executor` (a `MultiprocExecutor`) send every handed-off request's cache to its ranks with
    the step that first runs it."""
    executor.loaded_caches = lambda batch: loaded_caches(cache, batch)
