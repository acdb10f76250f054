"""The verification call's cache view: keeps the KDA state after every position, for rollback.

A recurrent state cannot be rewound. During verification each KDA layer steps through the
K + 1 tokens one at a time and hands this view the conv and recurrent state after each of them
(`keeps_kda_checkpoints`, `model/kda_layer.py`); the slot itself receives the state after the
last draft. Once the accepted length a is known, `restore(row, a)` writes the state after
position a (the pending token plus a drafts) back into the row's slot: SGLang's approach. The
other option, restoring the state from before the step and replaying the accepted tokens
through the model, costs a second forward whenever a draft is rejected (docs/serving-speculative.md).
Latent and indexer rows past the accepted length need no rollback: attention never reads a
position at or past a row's computed length, and the next step overwrites them.
"""

from __future__ import annotations

import torch

from deltamoe.serve.engine.cache_view import PagedBatchView


class CheckpointView(PagedBatchView):
    keeps_kda_checkpoints = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots = self._slots.tolist()
        self._checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep_kda_checkpoints(self, layer: int, conv_states: torch.Tensor, recurrent_states: torch.Tensor) -> None:
        """conv [B, T, 3P, W-1] and recurrent [B, T, H, K, V] states after each new position."""
        self._checkpoints[layer] = (conv_states, recurrent_states)

    def restore(self, row: int, position: int) -> None:
        """Put the state after new token `position` (0 = the first) of `row` into its slot."""
        cache, slot = self._cache, self.slots[row]
        for layer, (conv, recurrent) in self._checkpoints.items():
            i = cache.kda_index[layer]
            cache.conv[i, slot] = conv[row, position].transpose(0, 1)  # the cache keeps it [W-1, 3P]
            cache.recurrent[i, slot] = recurrent[row, position]
