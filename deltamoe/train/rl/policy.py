"""The trainer's side of GRPO: the policy on one process or sharded with FSDP2 over torchrun's data
ranks (the train stack's `parallelize`), its AdamW, and the clipped policy-gradient update.

Under `--dp N` every rank holds a shard of the policy and a whole frozen reference copy (for the
KL); every rank gets the whole rollout batch and trains on its contiguous block of rows. The loss
is normalised by the global batch's completion tokens and FSDP2 sums the gradients (divide factor
1), so an update equals one process's on the same batch up to the order of the float sums.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deltamoe.model.model import DeltaMoEForCausalLM
from deltamoe.parallel.compose import parallelize
from deltamoe.parallel.data_parallel import fsdp_view_warning_ignored
from deltamoe.parallel.dims import ParallelDims
from deltamoe.parallel.mesh import ParallelMesh
from deltamoe.train.checkpoint import load_optimizer_state
from deltamoe.train.config import OptimSection
from deltamoe.parallel.eval_forward import next_token_logits
from deltamoe.train.optim import LRSchedule, Optimizers
from deltamoe.train.rl.config import RLConfig
from deltamoe.train.rl.batch import RolloutTensors, scored_logprobs
from deltamoe.train.rl.grpo import grpo_loss


class SGDOptimizers(Optimizers):
    """Plain SGD (no momentum) behind the `Optimizers` interface (schedule, checkpoints). With the
    gradient clipped to `max_grad_norm` each step moves the policy by at most lr * max_grad_norm in
    L2, where AdamW's per-coordinate normalisation moves every parameter by up to ~lr whatever
    the size of its share of the policy gradient."""

    def __init__(self, parts: list[torch.nn.Module], lr: float, warmup_steps: int, total_steps: int):
        self.parts = parts
        self.schedule = LRSchedule(lr, warmup_steps, total_steps, min_lr_ratio=1.0)
        self.optimizers = [torch.optim.SGD([p for p in part.parameters() if p.requires_grad], lr=lr)
                           for part in parts]


class PolicyTrainer:
    def __init__(self, policy: DeltaMoEForCausalLM, cfg: RLConfig, mesh: ParallelMesh | None):
        """`policy` whole, in training mode; `mesh` None for one process, else the data ranks' mesh."""
        self.cfg = cfg
        self.reference = copy.deepcopy(policy).eval().requires_grad_(False)  # the initial policy, for the KL
        self.world = 1 if mesh is None else mesh.size()
        self.pm = parallelize(policy, ParallelDims(dp=self.world), mesh)
        self.parts = self.pm.model_parts
        self.module = self.parts[0]  # the model itself, or this rank's FSDP2-sharded whole-model stage
        total = cfg.steps * cfg.updates_per_batch
        if cfg.optimizer == "sgd":
            self.optimizers: Optimizers = SGDOptimizers(self.parts, cfg.lr, cfg.warmup_steps, total)
        else:
            optim = OptimSection(lr=cfg.lr, warmup_steps=cfg.warmup_steps, weight_decay=0.0, min_lr_ratio=1.0,
                                 clip_grad=cfg.max_grad_norm)
            self.optimizers = Optimizers(self.parts, optim, total)
        if cfg.init_optimizer is not None:
            self._carry_second_moments(Path(cfg.init_optimizer))

    def _carry_second_moments(self, path: Path) -> None:
        """AdamW's step count and second moments from a supervised checkpoint: per-parameter step sizes
        on the scale its gradients set, past the bias-corrected start. The first moment is zeroed: it
        is the supervised gradient's direction, which would keep taking supervised steps for ~1 / (1 -
        beta1) RL steps and mix them into what RL is credited with."""
        load_optimizer_state(path, self.parts, self.optimizers, field="init_optimizer")
        for optimizer in self.optimizers.optimizers:
            for state in optimizer.state.values():
                state["exp_avg"].zero_()

    def update(self, batch: RolloutTensors, step: int) -> dict[str, Any]:
        """`updates_per_batch` optimizer steps on GRPO step `step`'s batch; the metrics of the global batch."""
        with fsdp_view_warning_ignored():
            return self._update(batch, step)

    def _update(self, batch: RolloutTensors, step: int) -> dict[str, Any]:
        cfg = self.cfg
        tokens = batch.weight.sum().clamp(min=1.0)  # the global normaliser: every rank divides by it
        b = batch.block(self.pm.dp_rank, self.pm.dp_size)
        # Micro-batches of rows, their gradients summed: the same update in bounded memory. Every rank
        # has as many rows, hence as many forwards (FSDP2's gathers need every rank in each).
        parts = -(-b.ids.shape[0] // cfg.micro_rows)
        chunks = [b.block(k, parts) for k in range(parts)] if parts > 1 else [b]
        with torch.no_grad():
            ref = [scored_logprobs(self.reference(c.ids).logits, c, cfg.temperature) for c in chunks]
        old: list[torch.Tensor] = []
        gap = torch.zeros(0)
        sums = torch.zeros(4)  # loss, policy loss, KL, clipped tokens: summed over the updates, this rank's share
        for u in range(cfg.updates_per_batch):
            lr = self.optimizers.set_lr((step - 1) * cfg.updates_per_batch + u + 1)
            for k, c in enumerate(chunks):
                logits = next_token_logits(self.module, c.ids)
                logp = scored_logprobs(logits, c, cfg.temperature)
                if u == 0:  # the policy that sampled (the engine holds the same weights): the first forward's
                    old.append(logp.detach())
                    with torch.no_grad():  # raw logprobs, as the engine reports
                        gap = torch.cat([gap, (scored_logprobs(logits, c) - c.engine_logp).abs()])
                result = grpo_loss(logp, old[k], c.advantage, c.weight, cfg.clip_eps, ref[k], cfg.kl_coef,
                                   tokens=tokens)
                result.loss.backward()
                kl = result.kl if u == cfg.updates_per_batch - 1 else 0.0  # the KL after the last update's forward
                sums += torch.tensor([float(result.loss.detach()), result.policy_loss, kl, result.clip_fraction])
            grad_norm = self.pm.clip_grad_norm_(cfg.max_grad_norm)
            self.optimizers.step()
            self.optimizers.zero_grad()
        sums = self.pm.all_reduce_sum(sums)
        weight = torch.cat([c.weight for c in chunks])
        gap_sum = self.pm.all_reduce_sum(torch.tensor([float((gap * weight).sum()), float(weight.sum())]))
        gap_max = torch.tensor([float(gap.max()) if gap.numel() else 0.0])
        if self.world > 1:
            dist.all_reduce(gap_max, op=dist.ReduceOp.MAX)
        n = cfg.updates_per_batch
        return {"loss": float(sums[0]) / n, "policy_loss": float(sums[1]) / n, "kl": float(sums[2]),
                "clip_fraction": float(sums[3]) / n,
                "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
                "lr": lr, "completion_tokens": int(tokens),
                "logprob_mismatch": float(gap_sum[0] / gap_sum[1]) if gap_sum[1] else 0.0,
                "logprob_mismatch_max": float(gap_max[0]), "train_rows": int(batch.ids.shape[0]),
                "advantage_nonzero": float((batch.weight * (batch.advantage != 0)).sum() / tokens)}
