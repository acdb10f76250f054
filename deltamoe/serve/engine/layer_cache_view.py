"""LayerCacheView: one layer's share of a `PagedBatchView`, handed to a compiled region.

A compiled region (`compiled_regions.py`) is one layer's attention or FFN, and one graph serves
every layer of its kind. The batch view finds a layer's pages by its index (`cache.latent[i]`
for layer i), which a graph would bake in as a constant and compile again for every layer. This
view is built eagerly, per layer and step, over that layer's own slices of the cache tensors, so
the graph sees only tensors: the `layer` arguments of the `ModelCache` calls are ignored.

Writes go into the slices in place (`index_put_` on a graph input, kept in place by inductor);
the page rows of the step's tokens are the batch view's, built once per step. With fp8 pages
(`kv_cache_dtype="fp8"`) the layer's scale slices travel along: rows are quantised as they are
written and dequantised as they are read, inside the graph, as the batch view does eagerly.
"""

from __future__ import annotations

import torch

from deltamoe.ops.quant import dequantize_fp8_act, quantize_fp8_act
from deltamoe.serve.engine.cache_layout import fp8_tile
from deltamoe.serve.engine.cache_view import PagedBatchView


class LayerCacheView:
    def __init__(self, view: PagedBatchView, layer: int):
        cache = view._cache
        if view._first_row is not None:
            raise ValueError("LayerCacheView: expected a view that gathers its pages (slice_consecutive off)")
        if view._fresh:
            raise ValueError("LayerCacheView: expected decode rows with a past (a fresh row is a prefill)")
        self.past_lengths, self.new_lengths = view.past_lengths, view.new_lengths
        self._slots, self._table, self._block_size = view._slots, view._table, cache.block_size
        self._write, self._read = view._write, view._read
        self._dtype = cache.layout.dtype
        self._conv = self._recurrent = self._latent = self._index_keys = None
        self._latent_scale = self._index_key_scale = None  # fp8 pages: the layer's per-tile scales
        if layer in cache.kda_index:
            i = cache.kda_index[layer]
            self._conv, self._recurrent = cache.conv[i], cache.recurrent[i]
        if layer in cache.latent_index:
            i = cache.latent_index[layer]
            self._latent = cache.latent[i]
            self._latent_scale = cache.latent_scale[i] if cache.latent_scale is not None else None
        if layer in cache.index_key_index:
            i = cache.index_key_index[layer]
            self._index_keys = cache.index_keys[i]
            self._index_key_scale = cache.index_key_scale[i] if cache.index_key_scale is not None else None

    def kda_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv = self._conv.index_select(0, self._slots).transpose(1, 2)  # stored [W-1, 3P]
        return conv, self._recurrent.index_select(0, self._slots)

    def set_kda_state(self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        self._conv.index_put_((self._slots,), conv_state.transpose(1, 2).to(self._conv.dtype))
        self._recurrent.index_put_((self._slots,), recurrent_state.to(self._recurrent.dtype))

    def _store(self, pages: torch.Tensor, scales: torch.Tensor | None, new: torch.Tensor) -> None:
        rows = new.reshape(-1, new.shape[-1])
        if scales is not None:
            rows, row_scales = quantize_fp8_act(rows, fp8_tile(rows.shape[-1]))
            scales.index_put_((self._write,), row_scales)
        pages.index_put_((self._write,), rows.to(pages.dtype))

    def _read_pages(self, pages: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        values = pages[rows]
        if scales is None:
            return values
        return dequantize_fp8_act(values, scales[rows], fp8_tile(values.shape[-1])).to(self._dtype)

    def store_latent(self, layer: int, latent: torch.Tensor) -> None:
        self._store(self._latent, self._latent_scale, latent)

    def append_latent(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        self._store(self._latent, self._latent_scale, latent)
        return self._read_pages(self._latent, self._latent_scale, self._read)

    def append_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        self._store(self._index_keys, self._index_key_scale, keys)
        return self._read_pages(self._index_keys, self._index_key_scale, self._read)

    def latent_rows(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        bs = self._block_size
        rows = (self._table.gather(1, positions // bs) * bs + positions % bs).reshape(-1)
        return self._read_pages(self._latent, self._latent_scale, rows).view(*positions.shape, -1)
