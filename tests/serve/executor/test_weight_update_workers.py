"""A weight update reaches every rank of a tp2 / ep2 replica: afterwards the replica answers exactly like
a single-process engine loaded from the trainer's checkpoint."""

from __future__ import annotations

import pytest

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.engine.weight_update import WeightUpdater
from deltamoe.serve.executor.config import WorkerConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, helpers):
    root = tmp_path_factory.mktemp("update")
    save_checkpoint(build_model(helpers.k31_tiny(), seed=3).eval(), root / "old")
    trainer = build_model(helpers.k31_tiny(), seed=11)
    save_checkpoint(trainer, root / "new")
    prompts = helpers.prompts(4, 6, 20, seed=5)
    want = [c.token_ids for c in LLMEngine.from_pretrained(root / "new", EngineConfig(cache_memory="8MiB"))
            .generate(prompts, GREEDY, progress=False)]
    return root, trainer, prompts, want


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_update_reaches_every_rank(setup, tp, ep):
    root, trainer, prompts, want = setup
    engine = LLMEngine.from_pretrained(root / "old", EngineConfig(cache_memory="8MiB"), workers=WorkerConfig(tp=tp, ep=ep))
    try:
        before = [c.token_ids for c in engine.generate(prompts, GREEDY, progress=False)]
        assert before != want
        updater = WeightUpdater(engine)
        updater.start_weight_update()
        updater.update_weights_from_tensors(trainer.state_dict().items())
        updater.finish_weight_update()
        assert [c.token_ids for c in engine.generate(prompts, GREEDY, progress=False)] == want
    finally:
        engine.shutdown()
