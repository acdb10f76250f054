"""PagedBatchView: the `ModelCache` one model call sees, built over HybridCache pages and slots.

Rows may sit at different past lengths and append T tokens each, or (prefill chunks of
different lengths packed into one call) be right-padded to T with `new_lengths` real tokens;
padding is never stored. Position p of row b lives at flat page row
`block_table[b][p // bs] * bs + p % bs` (vLLM's slot mapping). New latents and indexer keys are
scattered there in place, and all positions < past + T are gathered back into a contiguous
[B, S, D] tensor for attention (padding points at row 0 and is masked by the row's length). A
single row whose blocks are consecutive (the usual case for one long sequence) reads a slice of
the pages instead: no copy, so a decode step over a long context costs only what attention
itself reads. The KDA states are gathered from the rows' slots and written back.
"""

from __future__ import annotations

import copy

import torch

from deltamoe.ops.quant import dequantize_fp8_act, quantize_fp8_act
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.cache_layout import fp8_tile


class PagedBatchView:
    def __init__(self, cache: HybridCache, block_tables: list[list[int]], past_lengths: list[int],
                 slots: list[int], num_new_tokens: int | list[int], min_table_width: int = 1,
                 slice_consecutive: bool = True):
        """`num_new_tokens`: T for every row, or one count per row (rows right-padded to the longest).
        `min_table_width`: block tables are padded to at least this many columns (never read), as a
        compiled call asks (`compiled_decode.CompiledDecode.min_table_width`).
        `slice_consecutive`: a single row on consecutive blocks reads its pages as one slice; off,
        every row gathers its pages, so a compiled call has one graph for both layouts."""
        device = cache.latent.device
        bs = cache.block_size
        self._cache = cache
        self.past_lengths = torch.tensor(past_lengths, dtype=torch.long, device=device)
        counts = num_new_tokens if isinstance(num_new_tokens, list) else [num_new_tokens] * len(past_lengths)
        t = max(counts)
        ragged = min(counts) != t
        self.new_lengths = torch.tensor(counts, dtype=torch.long, device=device) if ragged else None
        self._fresh = all(p == 0 for p in past_lengths)  # every row starts from an empty state
        self._slots = torch.tensor(slots, dtype=torch.long, device=device)
        width = max(min_table_width, max(len(b) for b in block_tables))
        # One flat list, then a view: torch.tensor over a list of lists costs ~1 us per row.
        flat = [block for b in block_tables for block in b + [0] * (width - len(b))]
        table = torch.tensor(flat, dtype=torch.long, device=device).view(len(block_tables), width)
        total = max(p + n for p, n in zip(past_lengths, counts))
        self._table, self._total, self._num_new = table, total, t
        # Only real tokens are stored; padding positions are dropped before the write.
        self._real = (torch.arange(t, device=device) < self.new_lengths[:, None]).reshape(-1) if ragged else None
        self._write_rows: torch.Tensor | None = None
        blocks = block_tables[0][: -(-total // bs)]
        consecutive = (slice_consecutive and len(block_tables) == 1
                       and blocks == list(range(blocks[0], blocks[0] + len(blocks))))
        self._first_row = blocks[0] * bs if consecutive else None
        self._read_rows: torch.Tensor | None = None

    @property
    def _write(self) -> torch.Tensor:
        """Flat page row of every new real token, built on first use: inside a compiled decode graph
        these few index ops are fused into it instead of running eagerly before the call."""
        if self._write_rows is None:
            new_pos = self.past_lengths[:, None] + torch.arange(self._num_new, device=self._table.device)
            write = self._page_rows(new_pos.clamp(max=self._total - 1)).reshape(-1)  # [B * T]
            self._write_rows = write if self._real is None else write[self._real]
        return self._write_rows

    @property
    def _read(self) -> torch.Tensor:
        """[B, S] flat page row of every position < S, built once per call and only when the pages
        are not one consecutive slice (at long context the map itself costs several passes)."""
        if self._read_rows is None:
            pos = torch.arange(self._total, device=self._table.device)
            self._read_rows = self._page_rows(pos.expand(self._table.shape[0], -1))
        return self._read_rows

    def _page_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat page row of each position [B, N] of each row: vLLM's slot mapping."""
        bs = self._cache.block_size
        return self._table.gather(1, positions // bs) * bs + positions % bs

    def kda_state(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self._fresh:  # the model's own zero-state path, exactly as a lone prefill takes it
            return None, None
        i = self._cache.kda_index[layer]
        conv = self._cache.conv[i].index_select(0, self._slots).transpose(1, 2)  # stored [W-1, 3P]
        return conv, self._cache.recurrent[i].index_select(0, self._slots)

    def set_kda_state(self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        i = self._cache.kda_index[layer]
        _put(self._cache.conv, i, self._slots, conv_state.transpose(1, 2))
        _put(self._cache.recurrent, i, self._slots, recurrent_state)

    def _store(self, store: torch.Tensor, scales: torch.Tensor | None, layer: int, new: torch.Tensor) -> None:
        rows = new.reshape(-1, new.shape[-1])
        if self._real is not None:
            rows = rows[self._real]
        if scales is not None:  # fp8 pages: e4m3 values and one fp32 scale per tile
            rows, row_scales = quantize_fp8_act(rows, fp8_tile(rows.shape[-1]))
            _put(scales, layer, self._write, row_scales)
        _put(store, layer, self._write, rows)

    def _append(self, store: torch.Tensor, scales: torch.Tensor | None, layer: int, new: torch.Tensor) -> torch.Tensor:
        self._store(store, scales, layer, new)
        if self._first_row is not None:  # narrow, not a slice: its start and length stay symbols when compiled
            rows = [t[layer].narrow(0, self._first_row, self._total).unsqueeze(0) for t in (store, scales)
                    if t is not None]
        else:
            rows = [t[layer][self._read] for t in (store, scales) if t is not None]
        return rows[0] if scales is None else self._dequantize(*rows)

    def _dequantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8_act(values, scales, fp8_tile(values.shape[-1])).to(self._cache.layout.dtype)

    def append_latent(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        return self._append(self._cache.latent, self._cache.latent_scale, self._cache.latent_index[layer], latent)

    def store_latent(self, layer: int, latent: torch.Tensor) -> None:
        self._store(self._cache.latent, self._cache.latent_scale, self._cache.latent_index[layer], latent)

    def latent_rows(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Only the rows asked for, wherever their pages are: DSA decode's top-k reads stay
        O(k) per query even when a long sequence's blocks are scattered over the pool."""
        i = self._cache.latent_index[layer]
        rows = self._page_rows(positions).reshape(-1)
        pages = self._cache.latent[i].index_select(0, rows).view(*positions.shape, -1)
        if self._cache.latent_scale is None:
            return pages
        return self._dequantize(pages, self._cache.latent_scale[i].index_select(0, rows).view(*positions.shape, -1))

    def append_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        return self._append(self._cache.index_keys, self._cache.index_key_scale, self._cache.index_key_index[layer],
                            keys)

    def advance(self, num_tokens: int) -> None:
        self.past_lengths = self.past_lengths + (num_tokens if self.new_lengths is None else self.new_lengths)

    @property
    def gathers_pages(self) -> bool:
        """Whether every row reads its pages by gathering them (no one-slice read of consecutive blocks)."""
        return self._first_row is None

    def next_decode_view(self) -> "PagedBatchView":
        """The view of the decode step after this one, over the same block tables and slots, once a
        forward over this view advanced its past lengths (`advance`): a multi-step window's steps
        (`multi_step.py`) build their tables and slots once instead of once per step. The tables
        must already hold every block the next step writes; a view that reads one slice of
        consecutive blocks is not continued (the next step's block may not be consecutive)."""
        if self._num_new != 1 or self._real is not None:
            raise ValueError("next_decode_view: expected a decode view (one new token per row)")
        if not self.gathers_pages:
            raise ValueError("next_decode_view: expected a view that gathers its pages (slice_consecutive off)")
        if self._total + 1 > self._table.shape[1] * self._cache.block_size:
            raise ValueError("next_decode_view: the block tables do not hold the next step's block")
        view = copy.copy(self)
        view._total, view._fresh = self._total + 1, False
        view._write_rows = view._read_rows = None  # built again on first use, for the new positions
        return view


def _put(store: torch.Tensor, layer: int, index: torch.Tensor, values: torch.Tensor) -> None:
    """store[layer, index[i]] = values[i], written through the whole [L, N, ...] tensor rather than
    a view of one layer: in a compiled decode graph (`compiled_decode.py`) a write into a view
    of a graph input makes the graph rebuild the whole input (the entire cache) every step."""
    store.index_put_((torch.full_like(index, layer), index), values.to(store.dtype))
