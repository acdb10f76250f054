"""Request features on a tp * ep replica, against one process.

- Images: rank 0 encodes each image once and broadcasts the rows its calls splice in; greedy tokens
  equal one process's through chunked prefill (an image cut across steps) and prefix-cache hits keyed
  by image content, also with async scheduling (one process and tp2).
- Prompt logprobs: the other ranks join rank 0's (vocabulary-parallel) LM-head projections of the
  prompt's hidden states; the values equal one process's, chunk by chunk, beside plain requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.executor.config import WorkerConfig
from deltamoe.vision.preprocess import PreparedImage

IMG, N = 264, 6  # tiny-vision's placeholder id and tokens per 32 x 48 image
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# Small chunks, so an image's placeholders are split across steps; 4-token blocks for prefix hits.
CONFIG = dict(cache_memory="8MiB", block_size=4, max_num_batched_tokens=7)


def image(seed: int) -> PreparedImage:
    g = torch.Generator().manual_seed(seed)
    return PreparedImage(torch.randn(3, 32, 48, generator=g), N, content_hash=1000 + seed)


def prompt(before: int, after: int, images: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (before,), generator=g).tolist()
    for _ in range(images):
        ids += [IMG] * N + torch.randint(0, 256, (3,), generator=g).tolist()
    return ids + torch.randint(0, 256, (after,), generator=g).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-vision"
    # vocab 272 instead of 265: tp must divide the vocabulary (the embedding and LM head split by rows)
    config = dataclasses.replace(load_preset("tiny-vision"), vocab_size=272)
    save_checkpoint(build_model(config, seed=5).eval(), path)
    return str(path)


@pytest.fixture(scope="module")
def requests():
    a, b, c = image(1), image(2), image(3)
    return [(prompt(5, 4, 1, seed=1), [a]), (prompt(10, 3, 2, seed=2), [b, c]), (prompt(9, 3, 0, seed=3), []),
            (prompt(5, 4, 1, seed=1), [b])]  # the first prompt's text with another image


def generate(engine: LLMEngine, requests) -> list[list[int]]:
    out = engine.generate([ids for ids, _ in requests], GREEDY, progress=False, images=[ims for _, ims in requests])
    return [o.token_ids for o in out]


def count_encodes(engine: LLMEngine) -> list[int]:
    """Images the (rank 0) vision tower encodes from now on, one entry per call."""
    encoded: list[int] = []
    encode = engine.runner.model.encode_images
    engine.runner.model.encode_images = lambda pixels: encoded.append(len(pixels)) or encode(pixels)
    return encoded


@pytest.fixture(scope="module")
def expected(checkpoint, requests):
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(**CONFIG))
    encoded = count_encodes(engine)
    want = generate(engine, requests)
    assert want[0] != want[3]  # the image matters
    return want, sum(encoded)


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_images_on_workers_equal_one_process(checkpoint, requests, expected, tp, ep):
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(**CONFIG), workers=WorkerConfig(tp=tp, ep=ep))
    want, encodes = expected
    try:
        encoded = count_encodes(engine)
        assert generate(engine, requests) == want
        assert sum(encoded) == encodes  # as often as one process (rank 0 encodes; the ranks get rows)
        again = engine.generate([ids for ids, _ in requests], GREEDY, progress=False,
                                images=[ims for _, ims in requests])
        assert [o.token_ids for o in again] == want
        assert [o.num_cached_tokens for o in again] == [16, 28, 0, 16]  # prefix hits keyed by image content
        assert sum(encoded) == encodes  # the hits ran no encoder
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_images_with_async_scheduling_equal_one_step_at_a_time(checkpoint, requests, expected, tp):
    """Async scheduling encodes a step's images on the host as it plans the step (beside the step in
    flight); over --tp the rows follow the step message after the sampled ids."""
    workers = WorkerConfig(tp=tp) if tp > 1 else None
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(**CONFIG, async_scheduling=True), workers=workers)
    try:
        assert engine.overlap is not None
        want, _ = expected
        assert generate(engine, requests) == want
        assert generate(engine, requests) == want  # prefix hits
    finally:
        engine.shutdown()


SCORED = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_on_workers_equal_one_process(checkpoint, async_scheduling):
    """With async scheduling the projections go with the step rank 0's device thread sends."""
    prompts = [prompt(17, 0, 0, seed=20), prompt(3, 0, 0, seed=21), prompt(12, 5, 0, seed=22)]
    params = [SCORED, GREEDY, SCORED]  # the middle one asks for none, in the same calls
    one = LLMEngine.from_pretrained(checkpoint, EngineConfig(**CONFIG)).generate(prompts, params, progress=False)
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(**CONFIG, async_scheduling=async_scheduling),
                                       workers=WorkerConfig(tp=2))
    try:
        got = engine.generate(prompts, params, progress=False)
    finally:
        engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in one]
    assert got[1].prompt_logprobs is None
    for a, b in ((got[0], one[0]), (got[2], one[2])):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(prompts[0 if a is got[0] else 2]) - 1
        assert [t.token_id for t in a.prompt_logprobs] == [t.token_id for t in b.prompt_logprobs]
        torch.testing.assert_close([t.logprob for t in a.prompt_logprobs], [t.logprob for t in b.prompt_logprobs],
                                   rtol=0, atol=1e-4)
        assert [[i for i, _ in t.top] for t in a.prompt_logprobs] == [[i for i, _ in t.top] for t in b.prompt_logprobs]
