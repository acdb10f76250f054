"""Distributed-equals-single-process checks, run as one spawned gloo job per world size (spawn is slow).

Usage: python dist_job.py WORLD OUT.json CASE [CASE ...]
Every rank builds the same seeded model twice: one copy is parallelized and fed this rank's slice of
the global batch, the other runs the plain one-process step on the whole global batch. Rank 0 writes,
per case, the two losses, the worst relative gradient error over all parameters (full tensors gathered
from FSDP/TP/EP shards, each pipeline stage checking its own), the two gradient norms, and the
parameter names that no rank checked.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deltamoe.config import load_preset  # noqa: E402
from deltamoe.model.load import build_model  # noqa: E402
from deltamoe.parallel import ParallelDims, init_distributed, parallelize  # noqa: E402
from deltamoe.parallel.eval_forward import next_token_logits  # noqa: E402
from deltamoe.train.fp8 import Fp8Linear, Fp8Training  # noqa: E402


def k31_toy(**overrides):
    """KDA + DSA (top-k below T, so sparse) + MLA + dense layer 0 + latent MoE + AttnRes (4 blocks) + MTP."""
    base = dict(vocab_size=61, hidden_size=32, num_hidden_layers=8,
                layer_types=("kda", "kda", "dsa", "kda", "mla", "kda", "dsa", "mla"),
                kda_num_heads=4, kda_head_dim=8, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_num_heads=2, index_head_dim=8,
                index_topk=5, intermediate_size=48, num_experts=8, num_experts_per_token=3,
                moe_intermediate_size=16, latent_moe_size=20, attn_res_block_size=2, num_nextn_predict_layers=1,
                max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    return load_preset("tiny").replace(**base)


def kimi_linear_toy():
    """No AttnRes (plain residual), SiLU experts at hidden width, low-rank KDA gate; MTP added so the
    embeddings have to cross the pipeline in their own slot."""
    return k31_toy(model_type="kimi_linear", layer_types=("kda", "kda", "mla", "kda"), num_hidden_layers=4,
                   kda_gate="softplus", kda_output_gate="low_rank", mla_output_gate=False, hidden_act="silu",
                   latent_moe_size=None, latent_moe_norm=False, attn_res_block_size=None, q_lora_rank=None,
                   routed_scaling_factor=2.5, qk_rope_head_dim=4, mla_use_nope=False)


CASES = {
    "dp2": (k31_toy, ParallelDims(dp=2)),
    "ep2": (k31_toy, ParallelDims(ep=2)),  # dp inferred from the world: 2
    "ep2_ac_mb2": (k31_toy, ParallelDims(dp=2, ep=2, activation_checkpointing=True, microbatches=2)),
    "tp2": (k31_toy, ParallelDims(tp=2)),
    "tp2_kimi_linear": (kimi_linear_toy, ParallelDims(tp=2)),
    "pp2": (k31_toy, ParallelDims(pp=2, microbatches=2)),
    "pp2_interleaved": (k31_toy, ParallelDims(pp=2, schedule="interleaved1f1b", stages_per_rank=2, microbatches=2)),
    "pp2_kimi_linear": (kimi_linear_toy, ParallelDims(pp=2, microbatches=2)),
    "dp2_ep2_tp2": (k31_toy, ParallelDims(dp=2, ep=2, tp=2)),
    "dp4_ep2": (k31_toy, ParallelDims(dp=4, ep=2)),  # experts FSDP-sharded over the 2 remaining data ranks
    "pp2_dp2": (k31_toy, ParallelDims(pp=2, dp=2, microbatches=2)),
    "pp2_tp2_ac": (k31_toy, ParallelDims(pp=2, tp=2, schedule="interleaved1f1b", stages_per_rank=2, microbatches=2,
                                        activation_checkpointing=True)),
    # pipeline x experts: dp inferred (2), the EP group inside it on each stage; MTP and AttnRes on the stages
    "pp2_ep2": (k31_toy, ParallelDims(pp=2, ep=2, microbatches=2)),
    "pp2_ep2_interleaved_ac": (k31_toy, ParallelDims(pp=2, ep=2, schedule="interleaved1f1b", stages_per_rank=2,
                                                     microbatches=2, activation_checkpointing=True)),
    # the EP all-to-all in 3 asynchronous chunks, overlapped with expert compute
    "ep2_overlap": (k31_toy, ParallelDims(ep=2, ep_chunks=3)),
    # activation offload with EP-sharded experts (DTensor parameters without storage of their own), whole
    # layers, the MoE blocks alone, and the checkpoint inputs
    "ep2_offload_layer": (k31_toy, ParallelDims(ep=2, offload_activations="layer")),
    "ep2_offload_mlp": (k31_toy, ParallelDims(ep=2, offload_activations="mlp")),
    "ep2_ac_offload_layer": (k31_toy, ParallelDims(ep=2, activation_checkpointing=True, offload_activations="layer")),
    # activation offload of the checkpoint inputs under the interleaved (virtual stage) schedule
    "pp2_interleaved_ac_offload": (k31_toy, ParallelDims(pp=2, schedule="interleaved1f1b", stages_per_rank=2,
                                                         microbatches=2, activation_checkpointing=True,
                                                         offload_activations="layer")),
}

# Blockwise FP8 (train/fp8.py) on both sides. wgrad quantises along tokens in tiles of 128, so a data
# rank's tiles coincide with the one-process step's only when each rank holds a multiple of 128 tokens:
# 2 rows x 64 per rank, and no MTP (its layer sees T - 1 positions a row). Routed experts see the same
# rows in the same order under EP, so their tiles coincide anyway.
FP8_CASES = {
    "fp8_dp2_ep2": (lambda: k31_toy(num_nextn_predict_layers=0), ParallelDims(dp=2, ep=2)),
}
FP8_SEQ = 64

BATCH, SEQ = 4, 12  # global batch: up to 4 data ranks


def global_batch(config, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (BATCH, seq), generator=gen)
    labels = ids.clone()
    labels[torch.rand(BATCH, seq, generator=gen) < 0.25] = -100  # unequal token counts per rank and microbatch
    return ids, labels


def full_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


def layout(pm) -> dict:
    """What this rank actually holds: proves the parallelism was applied, not just that numbers match."""
    out: dict = {"layers": [], "expert_rows": None, "kda_heads": None, "mlp_cols": None, "fp8_linears": 0,
                 "dispatcher": None}
    for part in pm.model_parts:
        out["layers"] += [int(k) for k in part.model.layers]
        out["fp8_linears"] += sum(isinstance(m, Fp8Linear) for m in part.modules())
        out["dispatcher"] = out["dispatcher"] or next((type(m.dispatcher).__name__ for m in part.modules()
                                                       if hasattr(m, "dispatcher")), None)
        for n, p in part.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if n.endswith("experts.w1") and out["expert_rows"] is None:
                out["expert_rows"] = list(local.shape)
            if n.endswith("self_attn.q_proj.weight") and out["kda_heads"] is None:
                out["kda_heads"] = list(local.shape)
            if n.endswith("mlp.gate_proj.weight") and out["mlp_cols"] is None:
                out["mlp_cols"] = list(local.shape)
    return out


def run_case(name: str) -> dict:
    fp8 = name in FP8_CASES
    make_config, dims = FP8_CASES[name] if fp8 else CASES[name]
    config = make_config()
    ids, labels = global_batch(config, FP8_SEQ if fp8 else SEQ)
    converters = (lambda: [Fp8Training()]) if fp8 else list

    reference = build_model(config, seed=0).train()
    expected = parallelize(reference, ParallelDims(), None, converters()).forward_backward(ids, labels)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    ref_norm = torch.nn.utils.get_total_norm([g for g in ref_grads.values() if g is not None])

    dims = dims.resolve(config, dist.get_world_size())
    mesh = init_distributed(dims)  # the trainer's entry: the group exists, so it only builds the mesh
    pm = parallelize(build_model(config, seed=0).train(), dims, mesh, converters())
    rows = BATCH // pm.dp_size
    local = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
    result = pm.forward_backward(ids[local], labels[local])
    offloaded = torch.tensor(pm.offload_stats.take() if pm.offload_stats is not None else 0)
    dist.all_reduce(offloaded)
    eval_err, eval_holders, eval_sum = evaluation(pm, reference, ids, local)

    worst, worst_name, checked = 0.0, "", []
    for part in pm.model_parts:
        for n, p in part.named_parameters():
            n = n.replace("_checkpoint_wrapped_module.", "")
            g, ref = full_grad(p), ref_grads[n]
            if ref is None:
                assert g is None or not g.any(), f"{n}: gradient where the reference has none"
            else:
                assert g.shape == ref.shape, f"{n}: {type(p.grad)} {tuple(g.shape)} vs {tuple(ref.shape)}"
                err = float((g - ref).norm() / ref.norm().clamp(min=1e-30))
                worst, worst_name = max((worst, worst_name), (err, n))
            checked.append(n)
    worst_t = torch.tensor(worst)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    # torch.distributed.checkpoint sees the published names (no wrapper prefixes), every one on some rank.
    keys = [k for part in pm.model_parts for k in get_model_state_dict(part)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (checked, keys))
    norm = pm.clip_grad_norm_(1e9)
    pm.clip_grad_norm_(float(norm) / 2)  # scales every shard's gradient by one global factor
    clipped = pm.clip_grad_norm_(1e9)
    # The trainer's optimizer over model_parts: DTensors of several meshes (dp x tp, dp, ep) and plain tensors.
    torch.optim.AdamW([p for part in pm.model_parts for p in part.parameters()], lr=1e-3).step()
    return {"worst_param": worst_name if float(worst_t) == worst else None, "layout": layout(pm),
            "loss": float(result.loss), "ref_loss": float(expected.loss), "grad_rel_err": float(worst_t),
            "lm_loss": float(result.lm_loss), "ref_lm_loss": float(expected.lm_loss),
            "mtp_loss": _float(result.mtp_loss), "ref_mtp_loss": _float(expected.mtp_loss),
            "expert_load": result.expert_load.tolist(), "ref_expert_load": expected.expert_load.tolist(),
            "moe_rows": sorted(pm.moe_layers), "offloaded_bytes": int(offloaded),
            "norm": float(norm), "ref_norm": float(ref_norm), "clipped_norm": float(clipped),
            "eval_rel_err": eval_err, "eval_holders": eval_holders, "eval_sum": eval_sum[0],
            "ref_eval_sum": eval_sum[1], "world": dist.get_world_size(), "pp": pm.dims.pp,
            "unchecked": sorted(set(ref_grads) - {n for names, _ in everyone for n in names}),
            "state_dict_mismatch": sorted(set(reference.state_dict()) ^ {k for _, ks in everyone for k in ks})}


@torch.no_grad()
def evaluation(pm, reference, ids: torch.Tensor, local: slice) -> tuple[float, int, tuple[float, float]]:
    """The trainer's evaluation forward (`eval_logits`, through the stages under a pipeline) against the
    one-process model's logits: the worst relative error over the ranks, how many ranks got logits,
    and the logits' sum reduced as evaluation sums are (`all_reduce_eval_sums`) vs the reference's."""
    reference.eval()
    want = next_token_logits(reference, ids)
    reference.train()
    for part in pm.model_parts:
        part.eval()
    got = pm.eval_logits(ids[local])
    for part in pm.model_parts:
        part.train()
    err = torch.tensor(0.0 if got is None else float((got - want[local]).abs().max() / want.abs().max()))
    holders = torch.tensor(0 if got is None else 1)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    dist.all_reduce(holders)
    # Tensor ranks hold copies: count one per data rank, as the trainer's sums do (tp copies are equal).
    tp_rank = pm.mesh["tp"].get_local_rank() if pm.dims.tp > 1 else 0
    total = torch.tensor([0.0 if got is None or tp_rank else float(got.double().sum())], dtype=torch.float64)
    total = pm.all_reduce_eval_sums(total)
    return float(err), int(holders), (float(total[0]), float(want.double().sum()))


def _float(t: torch.Tensor | None) -> float | None:
    return None if t is None else float(t)


def _worker(rank: int, world: int, port: int, out: str, cases: list[str]) -> None:
    faulthandler.enable()  # a rank that crashes prints its Python stack into the job's stderr (the test shows it)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {name: run_case(name) for name in cases}
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    world, out, names = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    mp.spawn(_worker, args=(world, _free_port(), out, names), nprocs=world, join=True)
