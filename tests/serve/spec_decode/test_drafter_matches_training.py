"""The MTP drafter's drafts 1..K are what chained MTP training (`mtp_train_depth` = K) computes:
after every engine step, the drafter's depth-k logits equal the training depth-k logits at the
last computed position, with the drafts before it taken as the tokens that follow (as the drafter
feeds them). Holds across verification steps, so the catch-up and the provisional MTP latents
of drafts 2..K leave the cache as training sees it."""

from __future__ import annotations

import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.model.mtp_chain import mtp_states
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams


@torch.inference_mode()
def training_logits(model, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """[K, V] each training depth's logits at the chain of the last known token's predecessor."""
    ids = torch.tensor([tokens + drafts[:-1]])
    h = model(ids).hidden_states
    mtp = model.model.mtp_layers[0]
    states = mtp_states([mtp], h, model.model.embed_tokens(ids), len(drafts))
    chain = len(tokens) - 2  # its next token is the pending one, its depth-1 target the first draft
    return torch.stack([mtp.logits(s[0, chain]) for s in states])


@pytest.mark.parametrize("k", [2, 3])
def test_drafter_logits_equal_chained_training(helpers, k):
    model = build_model(helpers.k31_tiny(num_nextn_predict_layers=1, mtp_train_depth=k), seed=7).eval()
    eng = LLMEngine(model, config=EngineConfig(cache_memory="8MiB", speculative="mtp", num_draft_tokens=k,
                                               spec_min_acceptance=0.0))
    prompt = helpers.prompts(1, 11, 11, seed=4)[0]
    reference = helpers.reference_greedy(model, prompt, 24)
    seq = eng.make_sequence(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    eng.add_sequence(seq)
    drafter, seen, own = eng.runner.drafter, [], []
    pick, run = drafter._pick, drafter.run
    drafter._pick = lambda logits, seqs: (seen.append(logits[0].clone()), pick(logits, seqs))[1]

    def right_drafts(rows):
        """The drafter's own tokens noted, then replaced by the right ones: every draft is kept, so the
        catch-up runs over accepted drafts and the provisional latents are overwritten."""
        drafts = run(rows)
        own.append(list(drafts[0].tokens))
        start = drafts[0].position + 1 - len(prompt)
        drafts[0].tokens = reference[start:start + k]
        return drafts

    drafter.run = right_drafts
    for _ in range(4):
        seen.clear()
        eng.step()
        assert eng.runner.tracker.state(seq).drafts.position == len(seq.token_ids) - 1
        assert own[-1] == [int(torch.argmax(x)) for x in seen]
        torch.testing.assert_close(torch.stack(seen), training_logits(model, seq.token_ids, own[-1]),
                                   atol=1e-4, rtol=1e-4)
    assert seq.output_ids == reference[:1 + 3 * (k + 1)]
