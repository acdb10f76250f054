"""Tiny random-weight models for the engine tests, and the reference greedy decoder they are held to."""

from __future__ import annotations

import contextlib

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.model.cache import ContiguousCache
from deltamoe.model.load import build_model

# Tiny models are overhead-bound: one thread avoids oversubscribing the shared 2-core machine.
torch.set_num_threads(1)


def k31_tiny(**overrides):
    """K3.1-shaped toy: KDA + DSA (top-k 8, so contexts > 8 are really sparse) + latent MoE + AttnRes."""
    base = dict(hidden_size=32, num_hidden_layers=4, layer_types=("kda", "dsa", "kda", "dsa"),
                kda_num_heads=2, kda_head_dim=8, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=8,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_num_heads=2, index_head_dim=8,
                index_topk=8, intermediate_size=48, num_experts=4, num_experts_per_token=2,
                moe_intermediate_size=16, latent_moe_size=16, attn_res_block_size=2, num_nextn_predict_layers=0,
                max_position_embeddings=512)
    base.update(overrides)
    return load_preset("tiny").replace(**base)


def kimi_linear_tiny(**overrides):
    base = dict(model_type="kimi_linear", layer_types=("kda", "kda", "mla"), num_hidden_layers=3,
                kda_gate="softplus", kda_output_gate="low_rank", mla_output_gate=False, hidden_act="silu",
                latent_moe_size=None, latent_moe_norm=False, attn_res_block_size=None, q_lora_rank=None,
                num_shared_experts=1, routed_scaling_factor=2.5)
    base.update(overrides)
    return k31_tiny(**base)


@pytest.fixture(scope="session")
def k31_model():
    return build_model(k31_tiny(), seed=3).eval()


@pytest.fixture(scope="session")
def kimi_linear_model():
    return build_model(kimi_linear_tiny(), seed=5).eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding of one prompt with the model's own ContiguousCache: the oracle."""
    cache = ContiguousCache(model.config, batch_size=1, max_length=len(prompt) + max_tokens)
    logits = model(torch.tensor([prompt]), cache=cache).logits[0, -1]
    out = []
    for _ in range(max_tokens):
        token = int(torch.argmax(logits))
        out.append(token)
        logits = model(torch.tensor([[token]]), cache=cache).logits[0, -1]
    return out


def prompts(n: int, lo: int, hi: int, vocab: int = 256, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [(prefix or []) + torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


@contextlib.contextmanager
def openai_server(folder, config, seed: int = 2, model_name: str = "tiny", **model_overrides):
    """An `openai` client of a server (in a thread) over a k31_tiny checkpoint saved to `folder`."""
    import openai

    from deltamoe.model.weights import save_checkpoint
    from deltamoe.serve.api.server import build_app
    from deltamoe.serve.api.thread import ServerThread
    from deltamoe.serve.engine.async_engine import AsyncLLMEngine

    save_checkpoint(build_model(k31_tiny(**model_overrides), seed=seed), folder)
    with ServerThread(build_app(AsyncLLMEngine.from_pretrained(folder, config), model_name)) as thread:
        yield openai.OpenAI(base_url=f"{thread.url}/v1", api_key="none", max_retries=0, timeout=60)


def step_until_decode(engine) -> tuple[object, tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """Step `engine` until its first running request has only its last token left to compute (its
    next step is a decode step): (that sequence, the cache's tensors, a copy of them now)."""
    seq = engine.scheduler.running[0] if engine.scheduler.running else None
    while seq is None or seq.num_computed < len(seq.token_ids) - 1:
        engine.step()
        seq = engine.scheduler.running[0]
    cache = engine.cache
    tensors = (cache.conv, cache.recurrent, cache.latent, cache.index_keys)
    return seq, tensors, [t.clone() for t in tensors]


# With --import-mode=importlib test files cannot import this module; they take these as fixtures.
@pytest.fixture(scope="session")
def helpers():
    class Helpers:
        pass

    h = Helpers()
    h.prompts, h.reference_greedy, h.k31_tiny, h.kimi_linear_tiny = prompts, reference_greedy, k31_tiny, kimi_linear_tiny
    h.openai_server, h.step_until_decode = openai_server, step_until_decode
    return h
