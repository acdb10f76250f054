"""LayerCacheView: one layer's share of a `PagedBatchView`, handed to a compiled region.

A compiled region (`compiled_regions.py`) is one layer's attention or FFN, and one graph serves
every layer of its kind. The batch view finds a layer's pages by its index (`cache.latent[i]`
for layer i), which a graph would bake in as a constant and compile again for every layer. This
view is built eagerly, per layer and step, over that layer's own slices of the cache tensors, so
the graph sees only tensors: the `layer` arguments of the `ModelCache` calls are ignored.

Writes go into the slices in place (`index_put_` on a graph input, kept in place by inductor);
the page rows of the step's tokens are the batch view's, built once per step.
"""

from __future__ import annotations

import torch

from deltamoe.serve.engine.cache_view import PagedBatchView


class LayerCacheView:
    def __init__(self, view: PagedBatchView, layer: int):
        cache = view._cache
        if cache.latent_scale is not None:
            raise ValueError("LayerCacheView: fp8 pages are not supported (compiled decode runs bf16/fp32 caches)")
        if view._first_row is not None:
            raise ValueError("LayerCacheView: expected a view that gathers its pages (slice_consecutive off)")
        if view._fresh:
            raise ValueError("LayerCacheView: expected decode rows with a past (a fresh row is a prefill)")
        self.past_lengths, self.new_lengths = view.past_lengths, view.new_lengths
        self._slots, self._table, self._block_size = view._slots, view._table, cache.block_size
        self._write, self._read = view._write, view._read
        self._conv = self._recurrent = self._latent = self._index_keys = None
        if layer in cache.kda_index:
            i = cache.kda_index[layer]
            self._conv, self._recurrent = cache.conv[i], cache.recurrent[i]
        if layer in cache.latent_index:
            self._latent = cache.latent[cache.latent_index[layer]]
        if layer in cache.index_key_index:
            self._index_keys = cache.index_keys[cache.index_key_index[layer]]

    def kda_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv = self._conv.index_select(0, self._slots).transpose(1, 2)  # stored [W-1, 3P]
        return conv, self._recurrent.index_select(0, self._slots)

    def set_kda_state(self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        self._conv.index_put_((self._slots,), conv_state.transpose(1, 2).to(self._conv.dtype))
        self._recurrent.index_put_((self._slots,), recurrent_state.to(self._recurrent.dtype))

    def _store(self, pages: torch.Tensor, new: torch.Tensor) -> None:
        pages.index_put_((self._write,), new.reshape(-1, new.shape[-1]).to(pages.dtype))

    def store_latent(self, layer: int, latent: torch.Tensor) -> None:
        self._store(self._latent, latent)

    def append_latent(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        self._store(self._latent, latent)
        return self._latent[self._read]

    def append_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        self._store(self._index_keys, keys)
        return self._index_keys[self._read]

    def latent_rows(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        bs = self._block_size
        rows = (self._table.gather(1, positions // bs) * bs + positions % bs).reshape(-1)
        return self._latent.index_select(0, rows).view(*positions.shape, -1)
