"""Draft tokens from the model's first MTP layer, reused autoregressively for K > 1.

The MTP layer at position i reads the trunk's hidden state h_i and the embedding of token i+1
and predicts token i+2 (`model/mtp.py`, as trained). Its attention runs over the context, so
its latents are paged like a trunk layer's (`CacheLayout(mtp_layers=1)`), at the same positions.

Each step, for every speculating row:
- catch-up: one MTP call over the positions the trunk computed this step (the hidden states it
  returned, with the next tokens now known: prompt tokens, accepted drafts, the new token); this
  keeps the MTP latents complete for every computed position, prefix-cache blocks included;
- drafting (rows whose next token was just produced): the catch-up's output at the last
  position gives draft 1; draft j > 1 runs the same layer on (its own previous output, the
  embedding of draft j-1) one position further, as vLLM and SGLang reuse DeepSeek's single MTP
  layer. Those later positions' latents are provisional: next step's catch-up overwrites them
  with the trunk's states. Checkpoints with several MTP layers draft with the first only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.serve.engine.cache import HybridCache
from deltamoe.serve.engine.cache_view import PagedBatchView
from deltamoe.serve.engine.sequence import Sequence
from deltamoe.serve.spec_decode.acceptance import draft_probs
from deltamoe.serve.spec_decode.compiled_draft import CompiledDraft
from deltamoe.serve.spec_decode.tracker import Drafts


@dataclass
class CatchUp:
    seq: Sequence
    start: int  # first position the trunk computed this step
    hidden: torch.Tensor  # [T, D] trunk hidden states at positions start .. start+T-1
    next_tokens: list[int]  # [T] tokens start+1 .. start+T
    draft: bool  # propose drafts from the last position (its next token is the pending one)


def following_tokens(seq: Sequence, n: int, token: int | None) -> list[int]:
    """The next tokens of the n positions a step computed from `seq.num_computed` on: the sequence's
    own tokens, then `token`, the one it sampled (None for a prefill chunk short of the prompt's end)."""
    start = seq.num_computed
    return seq.token_ids[start + 1:start + n] + [token if token is not None else seq.token_ids[start + n]]


class MTPDrafter:
    def __init__(self, model: DeltaMoEForCausalLM, cache: HybridCache, num_draft_tokens: int,
                 compiled: CompiledDraft | None = None):
        """`compiled`: the MTP layer through compiled regions, for the calls it runs (`--compile`)."""
        self.mtp = model.model.mtp_layers[0]
        self.embed = model.model.embed_tokens
        self.cache = cache
        self.k = num_draft_tokens
        self.compiled = compiled

    @torch.inference_mode()
    def run(self, rows: list[CatchUp]) -> list[Drafts | None]:
        """Catch up every row; drafts for the rows that ask, None for the others."""
        if not rows:
            return []
        counts = [len(r.next_tokens) for r in rows]
        t, d = max(counts), rows[0].hidden.shape[-1]
        hidden = rows[0].hidden.new_zeros(len(rows), t, d)
        ids = torch.zeros(len(rows), t, dtype=torch.long, device=hidden.device)
        for b, r in enumerate(rows):
            hidden[b, :counts[b]] = r.hidden
            ids[b, :counts[b]] = torch.tensor(r.next_tokens, device=hidden.device)
        out = self.call(hidden, ids, [r.seq for r in rows], [r.start for r in rows], counts)
        last = out[torch.arange(len(rows)), torch.tensor(counts) - 1]  # [B, D]
        drafting = [b for b, r in enumerate(rows) if r.draft]
        drafts: list[Drafts | None] = [None] * len(rows)
        if not drafting:
            return drafts
        seqs = [rows[b].seq for b in drafting]
        prev = last[drafting]
        tokens, probs = self._pick(self.mtp.logits(prev), seqs)
        steps_tokens, steps_probs = [tokens], [probs]
        positions = [rows[b].start + counts[b] for b in drafting]  # the pending token's position
        for j in range(1, self.k):
            ids = torch.tensor(steps_tokens[-1], device=prev.device)[:, None]
            prev = self.call(prev[:, None], ids, seqs, [p + j - 1 for p in positions], [1] * len(seqs))[:, 0]
            tokens, probs = self._pick(self.mtp.logits(prev), seqs)
            steps_tokens.append(tokens)
            steps_probs.append(probs)
        for i, b in enumerate(drafting):
            row_probs = None if steps_probs[0][i] is None else torch.stack([p[i] for p in steps_probs])
            drafts[b] = Drafts(position=positions[i], tokens=[s[i] for s in steps_tokens], probs=row_probs)
        return drafts

    def call(self, hidden: torch.Tensor, next_ids: torch.Tensor, seqs: list[Sequence], starts: list[int],
             counts: list[int]) -> torch.Tensor:
        """The MTP layer over new positions starts[b] .. starts[b]+counts[b]-1 of each row -> [B, T, D]."""
        compiled = self.compiled if self.compiled is not None and self.compiled.runs(starts, counts) else None
        view = PagedBatchView(self.cache, [s.block_table for s in seqs], starts, [s.slot for s in seqs], counts,
                              min_table_width=1 if compiled is None else compiled.min_table_width,
                              slice_consecutive=compiled is None)
        return (self.mtp if compiled is None else compiled)(hidden, self.embed(next_ids), view)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft per row: the argmax for greedy requests, else a draw from the request's distribution."""
        greedy = torch.argmax(logits, dim=-1).tolist()
        tokens: list[int] = []
        probs: list[torch.Tensor | None] = []
        for i, seq in enumerate(seqs):
            if seq.params.greedy:
                tokens.append(greedy[i])
                probs.append(None)
            else:
                q = draft_probs(logits[i], seq.params)
                tokens.append(int(torch.multinomial(q, 1, generator=seq.generator)))
                probs.append(q)
        return tokens, probs
