"""The MTP states at every training depth, in the two ways a checkpoint trains its MTP layers.

Depth k at chain index i predicts token i+k+1 from the depth-(k-1) state at i (the trunk's h_i
for k = 1) and the embedding of token i+k.

- One layer per depth (`mtp_train_depth` = 1, DeepSeek-V3): depth k runs MTP layer k as a causal
  pass over its own states, at positions 0 .. T-1-k.
- One layer applied recursively (`mtp_train_depth` = D > 1, one MTP layer): what the speculative
  drafter does with that layer (serve/spec_decode/mtp_drafter.py), trained as it runs there.
  Depth 1 is the plain causal pass. Depth k >= 2 of chain i sits at position i+k-1 and attends
  to the depth-1 latents of positions 0 .. i and to the latents of depths 2 .. k of the same
  chain (positions i+1 .. i+k-1): at draft time the MTP cache holds depth-1 latents for every
  position up to the last computed one, and draft k writes its provisional latent one position
  past draft k-1's. The loss then trains exactly the computation that drafts.
"""

from __future__ import annotations

import torch

from deltamoe.model.mla_layer import LatentAttention
from deltamoe.model.mtp import MTPLayer
from deltamoe.ops.mla import mla_attention


def mtp_states(layers: list[MTPLayer], h: torch.Tensor, embeds: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """h [B, T, D] trunk states, embeds [B, T, D] token embeddings -> the state of every depth k,
    [B, T-k, D] (chain indices 0 .. T-1-k). depth: `ModelConfig.mtp_train_depth`."""
    if depth == 1:
        states, prev = [], h
        for k, mtp in enumerate(layers, start=1):
            prev = mtp(prev[:, :-1], embeds[:, k:])
            states.append(prev)
        return states
    if len(layers) != 1:
        raise ValueError(f"mtp_train_depth {depth} reuses one MTP layer, the model has {len(layers)}")
    mtp = layers[0]
    attn: LatentAttention = mtp.self_attn  # type: ignore[assignment]
    b, t, _ = h.shape
    states = [mtp(h[:, :-1], embeds[:, 1:])]
    index = torch.arange(t, device=h.device)
    # Depth 1's latents, recomputed from the same input as inside its pass.
    x1 = mtp.input_layernorm(mtp.eh_proj(torch.cat([mtp.enorm(embeds[:, 1:]), mtp.hnorm(h[:, :-1])], dim=-1)))
    latents = [attn.latents(x1, index[None, :t - 1].expand(b, -1))]
    for k in range(2, depth + 1):
        n = t - k  # chains with a target at this depth
        inp = mtp.eh_proj(torch.cat([mtp.enorm(embeds[:, k:]), mtp.hnorm(states[-1][:, :n])], dim=-1))
        x = mtp.input_layernorm(inp)
        positions = index[None, k - 1:k - 1 + n].expand(b, -1)
        latents.append(attn.latents(x, positions))
        out = inp + _chained_attention(attn, x, positions, [lat[:, :n] for lat in latents[1:]], latents[0])
        states.append(out + mtp.ffn(mtp.post_attention_layernorm(out)))
    return states


def _chained_attention(attn: LatentAttention, x: torch.Tensor, positions: torch.Tensor,
                       chain: list[torch.Tensor], first: torch.Tensor) -> torch.Tensor:
    """Depth-k queries x [B, N, D] at `positions`; keys: the depth-1 latents `first` [B, T-1, L] of
    positions <= i, and this chain's latents of depths 2..k, `chain` (k-1 tensors [B, N, L])."""
    b, n, _ = x.shape
    _, q_nope, q_pe = attn.queries(x, positions)
    keys = torch.cat([first, *chain], dim=1)  # slots: T-1 depth-1 positions, then N per chained depth
    s1 = first.shape[1]
    chain_index = torch.arange(n, device=x.device)
    own = (chain_index[:, None] == chain_index[None, :]).repeat(1, len(chain))  # [N, N*(k-1)]: the same chain
    earlier = torch.arange(s1, device=x.device)[None, :] <= chain_index[:, None]  # [N, T-1]: positions 0 .. i
    selected = torch.cat([earlier, own], dim=1)[None].expand(b, -1, -1)
    latent_kv, k_pe = keys.split([attn.kv_rank, attn.rope], dim=-1)
    kv = attn.kv_b_proj(latent_kv).reshape(b, keys.shape[1], attn.num_heads, attn.nope + attn.vdim)
    k_nope, v = kv.split([attn.nope, attn.vdim], dim=-1)
    # Every slot is visible by position (the mask above is the whole rule): queries "at" the last slot.
    everything = torch.full((b, n), keys.shape[1] - 1, dtype=torch.long, device=x.device)
    o = mla_attention(q_nope, q_pe, k_nope, k_pe, v, scale=attn.scale, q_positions=everything,
                      kv_lengths=torch.full((b,), keys.shape[1], device=x.device), selected=selected)
    return attn.output(o, x)
