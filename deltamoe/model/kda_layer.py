"""Kimi Delta Attention block (spec §4.2): projections, short conv, decay gate, delta rule, gated norm.

Parameter names follow the published checkpoints (`self_attn.q_proj`, `q_conv1d`, `f_a_proj`,
`A_log`, `g_proj` or `g_a_proj`/`g_b_proj`, ...), so loading is a rename-free copy.
"""

from __future__ import annotations

import torch
from torch import nn

from deltamoe.config import ModelConfig
from deltamoe.model.cache import ModelCache
from deltamoe.ops.kda import chunk_kda, kda_step, kda_steps
from deltamoe.ops.kda_gate import causal_conv1d, kda_gate
from deltamoe.ops.norms import gated_rms_norm


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d, h, k = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        p = h * k
        self.num_heads, self.head_dim = h, k
        self.q_proj = nn.Linear(d, p, bias=False)
        self.k_proj = nn.Linear(d, p, bias=False)
        self.v_proj = nn.Linear(d, p, bias=False)
        w = config.kda_conv_size
        # Three depthwise convs, stored [P, 1, W] as in the checkpoints; applied as one [3P, W] conv.
        self.q_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.k_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.v_conv1d = nn.Conv1d(p, p, w, groups=p, bias=False)
        self.f_a_proj = nn.Linear(d, k, bias=False)
        self.f_b_proj = nn.Linear(k, p, bias=False)
        self.A_log = nn.Parameter(torch.empty(h))
        self.dt_bias = nn.Parameter(torch.empty(p))
        self.b_proj = nn.Linear(d, h, bias=False)
        if config.kda_output_gate == "full_rank":
            self.g_proj = nn.Linear(d, p, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, k, bias=False)
            self.g_b_proj = nn.Linear(k, p, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(k))
        self.o_proj = nn.Linear(p, d, bias=False)
        # (rank, size) of a tensor-parallel head shard: the projections are sharded by
        # parallel/tensor_parallel.py, while the small per-head parameters below stay whole (as
        # checkpoints, FSDP and state dicts name them) and are read through this rank's slice.
        self.head_shard: tuple[int, int] = (0, 1)

    def _local_heads(self, t: torch.Tensor) -> torch.Tensor:
        rank, size = self.head_shard
        return t if size == 1 else t.chunk(size, dim=0)[rank]

    def gate_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_log, dt_bias) of this module's heads."""
        return self._local_heads(self.A_log), self._local_heads(self.dt_bias)

    def conv_weight(self) -> torch.Tensor:
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return torch.cat([self._local_heads(c.weight) for c in convs], 0).squeeze(1)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.kda_output_gate == "full_rank":
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, cache: ModelCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        h, k = self.num_heads, self.head_dim
        conv_state, state = cache.kda_state(self.layer_idx) if cache is not None else (None, None)

        lengths = cache.new_lengths if cache is not None else None
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv, new_conv_state = causal_conv1d(raw, self.conv_weight(), conv_state, activation="silu", lengths=lengths)
        q, k_, v = (z.reshape(b, t, h, k) for z in qkv.chunk(3, dim=-1))

        a_log, dt_bias = self.gate_params()
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)), a_log, dt_bias, h,
                     kind=self.config.kda_gate, lower_bound=self.config.kda_gate_lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        if lengths is not None:
            # Right padding: with g = 0 (no decay) and beta = 0 (no write) a padded token leaves
            # the recurrent state exactly as the row's last real token left it.
            real = torch.arange(t, device=x.device) < lengths[:, None]  # [B, T]
            g = g * real[..., None, None]
            beta = beta * real[..., None]

        if cache is not None and t == 1 and state is not None:
            # Decode: one step of the recurrence for the whole batch.
            o, final_state = kda_step(q[:, 0], k_[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, use_qk_l2norm=True)
            o = o[:, None]
        elif state is not None and getattr(cache, "keeps_kda_checkpoints", False):
            # Speculative verification (serve/spec_decode/): step by step, keeping the state after
            # every position, so that rejected draft tokens roll back to the accepted one.
            o, states = kda_steps(q, k_, v, g, beta, state, use_qk_l2norm=True)
            final_state = states[:, -1]
            window = torch.cat([conv_state.to(raw.dtype), raw.transpose(1, 2)], dim=-1)  # [B, 3P, W-1+T]
            conv_states = window.unfold(-1, conv_state.shape[-1], 1)[:, :, 1:].transpose(1, 2)  # [B, T, 3P, W-1]
            cache.keep_kda_checkpoints(self.layer_idx, conv_states, states)
        else:
            o, final_state = chunk_kda(q, k_, v, g, beta, initial_state=state,
                                       output_final_state=cache is not None, use_qk_l2norm=True)
        if cache is not None:
            cache.set_kda_state(self.layer_idx, new_conv_state, final_state)

        o = gated_rms_norm(o, self.o_norm.weight, self.output_gate(x).reshape(b, t, h, k), self.config.rms_norm_eps)
        return self.o_proj(o.reshape(b, t, h * k))
