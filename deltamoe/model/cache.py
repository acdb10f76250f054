"""The cache interface a layer reads and writes, and a simple contiguous implementation.

A cache is an argument to the one model forward, not a second model (DESIGN contract 1).
Per sequence it holds, for each layer:
- KDA: the short-conv state [C, W-1] and the recurrent state [H, K, V] (fp32), fixed size;
- MLA: the compressed latent KV, 576 values per token in K3 (kv_lora + shared rope key);
- DSA: the indexer key per token.

The serving engine's paged HybridCache (`deltamoe.serve.engine.cache`) implements the same
interface over pages and state slots; `model` never imports `serve`. Rows of a batch may have
different past lengths (`past_lengths`); every row
appends the same number T of new tokens per forward.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from deltamoe.config import ModelConfig


@runtime_checkable
class ModelCache(Protocol):
    """What `DeltaMoEForCausalLM.forward` needs from a cache, for one batch of sequences."""

    past_lengths: torch.Tensor  # [B] long: tokens already cached per row
    # [B] long: real new tokens per row when rows are right-padded to a common T (a serving
    # engine packing prefill chunks of different lengths into one call); None: all T are real.
    # Layers then keep padding out of every state: KDA steps over it unchanged, attention never
    # sees it as a key, and the model's "last position" is each row's last real token.
    new_lengths: torch.Tensor | None

    def kda_state(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv_state [B, 3P, W-1], recurrent_state [B, H, K, V] fp32), or Nones before the first token."""
        ...

    def set_kda_state(self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None: ...

    def append_latent(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """Store [B, T, R + Dr] at positions past..past+T-1; return all [B, S, R + Dr] (S >= past + T)."""
        ...

    def store_latent(self, layer: int, latent: torch.Tensor) -> None:
        """`append_latent` without the read: DSA decode then reads only its top-k rows."""
        ...

    def latent_rows(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """The stored latents at `positions` [B, N] (long, each < past + T) -> [B, N, R + Dr]."""
        ...

    def append_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Store DSA indexer keys [B, T, Di]; return all [B, S, Di]."""
        ...

    def advance(self, num_tokens: int) -> None:
        """Called once at the end of a forward: past_lengths += num_tokens."""
        ...

    # Optional (speculative verification, serve/spec_decode/): a cache whose `keeps_kda_checkpoints`
    # is True gets, from each KDA layer, the states after every new position through
    # `keep_kda_checkpoints(layer, conv_states [B, T, 3P, W-1], recurrent_states [B, T, H, K, V])`.


class ContiguousCache:
    """Dense per-layer tensors for plain decoding loops, tests and simple batched decoding (the
    serving engine, and so `deltamoe generate`, uses the paged cache instead).

    Rows share one time axis of capacity `max_length`; a row with a shorter past simply has
    unused slots, which attention masks by `past_lengths`.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_length: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.config = config
        self.max_length = max_length
        self.past_lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.new_lengths = None  # rows always append T real tokens here
        self._conv: dict[int, torch.Tensor] = {}
        self._recurrent: dict[int, torch.Tensor] = {}
        self._latent: dict[int, torch.Tensor] = {}
        self._index_keys: dict[int, torch.Tensor] = {}
        self._dtype = dtype
        self._device = device

    @property
    def batch_size(self) -> int:
        return self.past_lengths.shape[0]

    def kda_state(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._conv.get(layer), self._recurrent.get(layer)

    def set_kda_state(self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        self._conv[layer] = conv_state
        self._recurrent[layer] = recurrent_state.float()

    def _append(self, store: dict[int, torch.Tensor], layer: int, new: torch.Tensor) -> torch.Tensor:
        b, t, d = new.shape
        end = int(self.past_lengths.max()) + t
        if end > self.max_length:
            raise ValueError(f"cache overflow: {end} tokens > max_length {self.max_length}")
        buf = store.get(layer)
        if buf is None:
            buf = torch.zeros(b, self.max_length, d, dtype=new.dtype, device=new.device)
            store[layer] = buf
        pos = self.past_lengths[:, None] + torch.arange(t, device=new.device)[None, :]  # [B, T]
        index = pos[..., None].expand(b, t, d)
        if new.requires_grad and torch.is_grad_enabled():
            buf = buf.scatter(1, index, new.to(buf.dtype))  # out of place keeps autograd intact
            store[layer] = buf
        else:
            buf.scatter_(1, index, new.to(buf.dtype))  # inference: no copy of the whole buffer
        return buf[:, :end]

    def append_latent(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        return self._append(self._latent, layer, latent)

    def store_latent(self, layer: int, latent: torch.Tensor) -> None:
        self._append(self._latent, layer, latent)

    def latent_rows(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        buf = self._latent[layer]
        return buf.gather(1, positions[..., None].expand(-1, -1, buf.shape[-1]))

    def append_index_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        return self._append(self._index_keys, layer, keys)

    def advance(self, num_tokens: int) -> None:
        self.past_lengths = self.past_lengths + num_tokens

    def nbytes(self) -> int:
        """Bytes held now (all layers, all rows)."""
        stores = (self._conv, self._recurrent, self._latent, self._index_keys)
        return sum(t.numel() * t.element_size() for s in stores for t in s.values())
