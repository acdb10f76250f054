"""Images through the engine: batching, chunked prefill and prefix caching never change results
(contract 5 for image prompts); the prefix cache keys image placeholders by the image's content."""

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.errors import RequestError
from deltamoe.model.cache import ContiguousCache
from deltamoe.model.load import build_model
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.vision.preprocess import PreparedImage

IMG, N = 264, 6
CACHE_FOR_PREEMPTION = 2 * 125_952 + 8 * 2048  # two KDA state slots and eight 4-token blocks
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build_model(load_preset("tiny-vision"), seed=5).eval()


def image(seed: int, h: int = 32, w: int = 48) -> PreparedImage:
    g = torch.Generator().manual_seed(seed)
    return PreparedImage(torch.randn(3, h, w, generator=g), (h // 16) * (w // 16), content_hash=1000 + seed)


def reference(model, ids: list[int], images: list[PreparedImage]) -> list[int]:
    cache = ContiguousCache(model.config, batch_size=1, max_length=len(ids) + GREEDY.max_tokens)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), cache=cache, images=[i.pixels for i in images] or None).logits[0, -1]
        out = []
        for _ in range(GREEDY.max_tokens):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache=cache).logits[0, -1]
    return out


def prompt(text_before: int, text_after: int, images: int = 1, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (text_before,), generator=g).tolist()
    for _ in range(images):
        ids += [IMG] * N + torch.randint(0, 256, (3,), generator=g).tolist()
    return ids + torch.randint(0, 256, (text_after,), generator=g).tolist()


def test_batched_chunked_and_cached_match_each_prompt_alone(model):
    a, b, c = image(1), image(2), image(3)
    reqs = [(prompt(5, 4, 1, seed=1), [a]), (prompt(10, 3, 2, seed=2), [b, c]), (prompt(9, 3, 0, seed=3), []),
            (prompt(5, 4, 1, seed=1), [b])]  # same text as the first, another image
    want = [reference(model, ids, ims) for ids, ims in reqs]
    # small chunks split images across steps; prefix caching on
    engine = LLMEngine(model, config=EngineConfig(cache_memory="8MiB", block_size=4, max_num_batched_tokens=7))
    got = engine.generate([ids for ids, _ in reqs], GREEDY, progress=False, images=[ims for _, ims in reqs])
    assert [g.token_ids for g in got] == want
    assert want[0] != want[3]  # the image matters
    # the same requests again: prefix hits (the whole prompt but its last block), same tokens
    again = engine.generate([ids for ids, _ in reqs], GREEDY, progress=False, images=[ims for _, ims in reqs])
    assert [g.token_ids for g in again] == want
    # all but the last block (the 12-token text prompt keeps no KDA snapshot before its last block)
    assert [g.num_cached_tokens for g in again] == [16, 28, 0, 16]


def test_prefix_cache_keys_by_image_content(model, monkeypatch):
    text = prompt(8, 9, 1, seed=7)  # 8 text tokens, the image at 8..13, then text
    engine = LLMEngine(model, config=EngineConfig(cache_memory="8MiB", block_size=4, snapshot_interval_blocks=1))
    encoded = []
    encode = model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda pixels: encoded.append(len(pixels)) or encode(pixels))
    first = engine.generate([text], GREEDY, progress=False, images=[[image(10)]])[0]
    same = engine.generate([text], GREEDY, progress=False, images=[[image(10)]])[0]
    other = engine.generate([text], GREEDY, progress=False, images=[[image(11)]])[0]
    assert encoded == [1, 1]  # the repeated image came from the prefix cache: no encoder run
    assert same.num_cached_tokens == 24 and same.token_ids == first.token_ids  # 26 tokens: all but the last block
    assert other.num_cached_tokens == 8  # only the text before the image
    assert other.token_ids == reference(model, text, [image(11)])


def test_image_requests_are_checked(model):
    engine = LLMEngine(model, config=EngineConfig(cache_memory="8MiB"))
    with pytest.raises(RequestError, match="holds 6 image placeholder tokens .* need 12") as e:
        engine.make_sequence(prompt(3, 3, 1), GREEDY, images=[image(1), image(2)])
    assert e.value.field == "prompt"
    seq = engine.make_sequence("what is this?", GREEDY, images=[image(1)])  # text prompt: image in front
    assert seq.token_ids[:N] == [IMG] * N and seq.num_prompt_tokens == N + len("what is this?")
    text_model = build_model(load_preset("tiny"), seed=0).eval()
    with pytest.raises(RequestError, match="no vision tower"):
        LLMEngine(text_model, config=EngineConfig(cache_memory="8MiB")).make_sequence("hi", GREEDY, images=[image(1)])


def test_one_encoder_call_per_step_across_requests(model, monkeypatch):
    calls = []
    encode = model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda pixels: calls.append(len(pixels)) or encode(pixels))
    engine = LLMEngine(model, config=EngineConfig(cache_memory="8MiB", enable_prefix_caching=False))
    reqs = [(prompt(4, 2, 1, seed=1), [image(1)]), (prompt(3, 5, 1, seed=2), [image(2)]),
            (prompt(6, 1, 1, seed=3), [image(1)])]
    got = engine.generate([ids for ids, _ in reqs], GREEDY, progress=False, images=[ims for _, ims in reqs])
    assert calls == [2]  # the three prompts prefill in one step: one packed call, image 1 encoded once
    assert [g.token_ids for g in got] == [reference(model, ids, ims) for ids, ims in reqs]


def test_preempted_image_requests_encode_again_and_keep_results(model, monkeypatch):
    calls = []
    encode = model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda pixels: calls.append(len(pixels)) or encode(pixels))
    reqs = [(prompt(2, 3, 1, seed=20 + i), [image(30 + i)]) for i in range(6)]
    engine = LLMEngine(model, config=EngineConfig(cache_memory=CACHE_FOR_PREEMPTION, block_size=4, max_num_batched_tokens=16,
                                                  max_state_fraction=0.95, enable_prefix_caching=False))
    got = engine.generate([ids for ids, _ in reqs], GREEDY, progress=False, images=[ims for _, ims in reqs])
    assert engine.stats().num_preemptions > 0 and sum(calls) > len(reqs)  # recomputed prompts encode again
    assert [g.token_ids for g in got] == [reference(model, ids, ims) for ids, ims in reqs]


def test_speculative_decoding_with_images_gives_the_plain_tokens(model):
    """The speculative runner's prefill calls carry the image rows (drafts only read the placeholder's
    token embedding; the target verifies with the rows): greedy tokens equal each prompt alone, batched,
    chunked and from the prefix cache, with speculation never switched off."""
    reqs = [(prompt(5, 4, 1, seed=1), [image(1)]), (prompt(10, 3, 2, seed=2), [image(2), image(3)])]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [LLMEngine(model, config=EngineConfig(cache_memory="8MiB", block_size=4)).generate(
        [ids], params, progress=False, images=[ims])[0].token_ids for ids, ims in reqs]
    engine = LLMEngine(model, config=EngineConfig(cache_memory="8MiB", block_size=4, max_num_batched_tokens=7,
                                                  speculative="mtp", num_draft_tokens=2, spec_min_acceptance=0.0))
    for _ in range(2):  # the second time from the prefix cache
        got = engine.generate([ids for ids, _ in reqs], params, progress=False, images=[ims for _, ims in reqs])
        assert [g.token_ids for g in got] == want
    assert engine.runner.tracker.verifications > 0
