"""Weight updates without a restart: after an update the engine answers exactly like a fresh engine
loaded from the trainer's checkpoint; a bad tensor is an error naming it, and the old weights stay."""

from __future__ import annotations

import pytest
import torch

from deltamoe.errors import RequestError
from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.engine.weight_transfer import TensorSpec, pack, plan_buckets, unpack
from deltamoe.serve.engine.weight_update import WeightUpdater

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(model) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(max_num_seqs=4, block_size=4, cache_memory=2**22))


def _tokens(engine: LLMEngine, prompts) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, GREEDY, progress=False)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, helpers):
    config = helpers.k31_tiny()
    trainer_model = build_model(config, seed=11)
    folder = tmp_path_factory.mktemp("trainer") / "model"
    save_checkpoint(trainer_model, folder)
    prompts = helpers.prompts(3, 5, 11, seed=4)
    fresh = _tokens(LLMEngine.from_pretrained(folder, EngineConfig(max_num_seqs=4, block_size=4, cache_memory=2**22)),
                    prompts)
    return config, trainer_model, prompts, fresh


def test_update_equals_fresh_engine_from_the_trainers_checkpoint(setup):
    config, trainer_model, prompts, fresh = setup
    engine = _engine(build_model(config, seed=3).eval())
    before = _tokens(engine, prompts + prompts[:1])  # the repeat fills the prefix cache with old-weight blocks
    assert before[:3] != fresh  # the update must change something for the test to mean anything
    updater = WeightUpdater(engine)
    updater.start_weight_update()
    updater.update_weights_from_tensors(trainer_model.state_dict().items())
    stats = updater.finish_weight_update()
    assert stats.version == 1 and stats.tensors == len(trainer_model.state_dict())
    assert engine.cache.blocks.hash_to_block == {} and not engine.cache.slots.snapshots
    assert _tokens(engine, prompts) == fresh


def test_a_bad_tensor_is_named_and_the_old_weights_keep_serving(setup):
    config, trainer_model, prompts, _ = setup
    engine = _engine(build_model(config, seed=3).eval())
    before = _tokens(engine, prompts)
    updater = WeightUpdater(engine)
    good = list(trainer_model.state_dict().items())
    for bad, field in [(("model.layers.0.nope.weight", torch.zeros(2)), "model.layers.0.nope.weight"),
                       (("lm_head.weight", torch.zeros(3, 3)), "lm_head.weight")]:
        updater.start_weight_update()
        with pytest.raises(RequestError) as e:
            updater.update_weights_from_tensors(good[:5] + [bad])
        assert e.value.field == field
        assert not updater.updating  # the staged half is dropped
        with pytest.raises(RequestError, match="start_weight_update"):
            updater.finish_weight_update()
    # NaN weights of the right shape: refused when the update finishes (NaN logits served token 0 with a 200)
    name, head = next((n, t) for n, t in good if n == "lm_head.weight")
    updater.start_weight_update()
    updater.update_weights_from_tensors(good[:5] + [(name, torch.full_like(head, float("nan")))])
    with pytest.raises(RequestError, match="non-finite") as e:
        updater.finish_weight_update()
    assert e.value.field == name and not updater.updating
    assert _tokens(engine, prompts) == before


def test_the_swap_waits_for_running_requests(setup):
    config, trainer_model, prompts, _ = setup
    engine = _engine(build_model(config, seed=3).eval())
    updater = WeightUpdater(engine)
    engine.add_request(prompts[0], GREEDY)
    updater.start_weight_update()
    updater.update_weights_from_tensors(trainer_model.state_dict().items())
    with pytest.raises(RequestError, match="still running"):
        updater.finish_weight_update()


def test_buckets_round_trip_every_dtype():
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.randn(2, 2, 2).double()]
    specs = [TensorSpec.of(f"t{i}", t) for i, t in enumerate(tensors)]
    assert plan_buckets(specs, 0) == [[0], [1], [2]]
    assert plan_buckets(specs, 80) == [[0, 1], [2]]  # 60 + 14 bytes fit, 64 more would not
    assert plan_buckets(specs, 16) == [[0], [1], [2]]  # a tensor over the limit travels alone
    assert plan_buckets(specs, 1 << 20) == [[0, 1, 2]]
    for got, want in zip(unpack(pack(tensors), specs), tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_server_swaps_between_the_running_requests_and_the_held_ones(setup):
    import asyncio

    from deltamoe.serve.engine.async_engine import AsyncLLMEngine

    config, trainer_model, prompts, fresh = setup
    engine = AsyncLLMEngine(_engine(build_model(config, seed=3).eval()))
    updater = WeightUpdater(engine.engine)
    updater.start_weight_update()
    updater.update_weights_from_tensors(trainer_model.state_dict().items())
    events: list[str] = []

    def swap():
        events.append(f"swap with {len(engine.engine.scheduler.running)} running")
        return updater.finish_weight_update()

    async def collect(prompt, name):
        out = []
        async for o in engine.generate(prompt, GREEDY):
            if not out:
                events.append(name)
            out += o.delta_token_ids
        return out

    async def main():
        first = asyncio.create_task(collect(prompts[0], "old starts"))
        while not events:
            await asyncio.sleep(0.001)
        done = asyncio.wrap_future(engine.run_when_idle(swap))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(collect(prompts[1], "new starts"))
        return await first, await done, await second

    try:
        _, stats, second = asyncio.run(main())
    finally:
        engine.shutdown()
    assert events == ["old starts", "swap with 0 running", "new starts"] and stats.version == 1
    assert second == fresh[1]  # the held request ran on the new weights
