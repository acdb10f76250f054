"""Parameter counts and weight bytes by precision, from a model built on the meta device.

Nothing is allocated: `torch.device("meta")` gives every parameter a shape and no storage,
so even the 2.8 T-parameter K3 counts in well under a second.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from deltamoe.config import ModelConfig

# Bytes per parameter: MXFP4 = 4-bit code + one E8M0 scale per 32 (spec §6).
MXFP4_BYTES = 0.5 + 1 / 32


@dataclass(frozen=True)
class ParamCounts:
    total: int  # text model, incl. MTP layers
    active: int  # per token: non-embedding active + lm_head (routed experts counted top_k of E)
    routed_experts: int
    embedding: int
    lm_head: int
    mtp: int
    vision: int  # vision tower + projector (0 without vision)

    @property
    def total_with_vision(self) -> int:
        return self.total + self.vision

    def weight_bytes(self) -> dict[str, float]:
        """Bytes of all weights (incl. vision) per storage format."""
        everything = self.total_with_vision
        rest = everything - self.routed_experts
        return {
            "bf16": 2.0 * everything,
            # FP8 matmul weights with a 128x128-block fp32 scale; embeddings and norms stay BF16-sized
            # at this accuracy (the difference is < 0.1 %), so everything counts 1 B + scales.
            "fp8": everything * (1.0 + 4.0 / (128 * 128)),
            "mxfp4_experts": self.routed_experts * MXFP4_BYTES + 2.0 * rest,
            "all_4bit": 0.5 * everything,
        }

    def to_dict(self) -> dict:
        return {**asdict(self), "total_with_vision": self.total_with_vision, "weight_bytes": self.weight_bytes()}


def count_parameters(config: ModelConfig) -> ParamCounts:
    from deltamoe.model.checkpoint_names import VISION_PREFIXES
    from deltamoe.model.model import DeltaMoEForCausalLM

    with torch.device("meta"):
        model = DeltaMoEForCausalLM(config)
    # Buffers that checkpoints store as tensors (router correction bias) count as parameters.
    tensors = {n: p for n, p in model.named_parameters() if not n.startswith(VISION_PREFIXES)}
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    total = routed = mtp = mtp_routed = 0
    for name, t in tensors.items():
        n = t.numel()
        is_routed = ".experts.w" in name
        is_mtp = (_layer_index(name) or 0) >= config.num_hidden_layers
        total += n
        routed += n if is_routed else 0
        mtp += n if is_mtp else 0
        mtp_routed += n if is_routed and is_mtp else 0
    embedding = model.model.embed_tokens.weight.numel()
    lm_head = 0 if config.tie_word_embeddings else model.lm_head.weight.numel()
    k, e = config.num_experts_per_token, max(config.num_experts, 1)
    trunk_routed = routed - mtp_routed
    # Active = trunk without input embedding and with only k of E routed experts (+ lm_head); MTP excluded.
    active = total - mtp - embedding - trunk_routed + trunk_routed * k // e
    if config.tie_word_embeddings:
        active += embedding  # the tied matrix is used as the LM head
    vis = sum(p.numel() for n, p in model.named_parameters() if n.startswith(VISION_PREFIXES))
    return ParamCounts(total=total, active=active, routed_experts=routed, embedding=embedding,
                       lm_head=lm_head, mtp=mtp, vision=vis)


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    return None
