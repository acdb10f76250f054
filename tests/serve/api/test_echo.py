"""/v1/completions `echo` with `logprobs` and `prompt_logprobs`, through the `openai` SDK: the
prompt's logprobs equal log_softmax(model(ids).logits), with chunked prefill and with the prompt
already in the prefix cache."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api.server import build_app
from deltamoe.serve.api.thread import ServerThread
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig

M = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory, helpers):
    folder = tmp_path_factory.mktemp("ckpt")
    model = build_model(helpers.k31_tiny(), seed=2).eval()
    save_checkpoint(model, folder)
    # 24-token prefill chunks: a 60-token prompt is scored over three chunks.
    engine = AsyncLLMEngine.from_pretrained(folder, EngineConfig(cache_memory="16MiB", max_model_len=256,
                                                                 max_num_batched_tokens=24))
    with ServerThread(build_app(engine, M)) as thread:
        yield openai.OpenAI(base_url=f"{thread.url}/v1", api_key="none", max_retries=0, timeout=60), model


def reference(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [logp[j - 1, ids[j]].item() for j in range(1, len(ids))]


def test_echo_logprobs_equal_the_model(served, helpers):
    client, model = served
    ids = helpers.prompts(1, 60, 60, seed=8)[0]
    want = reference(model, ids)
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache: still scored
        r = client.completions.create(model=M, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then the generated token
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp.token_logprobs[1:len(ids)], want))
        assert all(max(top.values()) >= t - 1e-6 for t, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
        assert r.choices[0].text.startswith(bytes(ids).decode("utf-8", errors="replace"))


def test_echo_text_and_prompt_logprobs(served):
    client, model = served
    prompt = "The capital of France is"
    r = client.completions.create(model=M, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=M, prompt=prompt, max_tokens=3, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text and r.choices[0].logprobs is None
    r = client.completions.create(model=M, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    ids = list(prompt.encode())
    assert pl[0] is None and len(pl) == len(ids)
    want = reference(model, ids)
    for j, entry in enumerate(pl[1:], start=1):
        assert math.isclose(entry[str(ids[j])]["logprob"], want[j - 1], abs_tol=1e-4) and 1 <= len(entry) <= 3
    streamed = client.completions.create(model=M, prompt=prompt, max_tokens=2, temperature=0, echo=True, stream=True)
    two = client.completions.create(model=M, prompt=prompt, max_tokens=2, temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == prompt + two.choices[0].text


def test_an_error_about_echos_prompt_logprobs_names_echo():
    """echo + logprobs asks the engine for prompt logprobs; a layout that cannot score prompts (workers,
    --async-scheduling) names the field the client sent, not `prompt_logprobs`."""
    from deltamoe.errors import RequestError
    from deltamoe.serve.api.params import completion_params, rename
    from deltamoe.serve.api.schemas import CompletionRequest

    params, names = completion_params(CompletionRequest(model="m", prompt="x", echo=True, logprobs=1), 300)
    assert params.prompt_logprobs == 1
    assert rename(RequestError("not yet", field="prompt_logprobs"), names).field == "echo"
    _, names = completion_params(CompletionRequest(model="m", prompt="x", prompt_logprobs=2, echo=True), 300)
    assert rename(RequestError("not yet", field="prompt_logprobs"), names).field == "prompt_logprobs"


def test_several_choices_each_echo_the_prompt_and_its_logprobs(served, helpers):
    """n > 1 and best_of: choices 2.. fork choice 1's prefill, and each gets the prompt's text and
    logprobs (copied from choice 1, which scored it), streamed or not."""
    client, model = served
    ids = helpers.prompts(1, 40, 40, seed=9)[0]
    want = reference(model, ids)
    text = bytes(ids).decode("utf-8", errors="replace")
    r = client.completions.create(model=M, prompt=ids, max_tokens=3, temperature=1.0, seed=5, n=3, echo=True,
                                  logprobs=1, extra_body={"prompt_logprobs": 1})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.text.startswith(text)
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 3
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp.token_logprobs[1:len(ids)], want))
        pl = c.model_extra["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(ids)
        assert all(math.isclose(e[str(ids[j])]["logprob"], want[j - 1], abs_tol=1e-4) for j, e in enumerate(pl[1:], 1))
    # choice i samples with seed 5 + i: choice 1 is the same request with n = 1 and seed 6
    one = client.completions.create(model=M, prompt=ids, max_tokens=3, temperature=1.0, seed=6, echo=True)
    assert r.choices[1].text == one.choices[0].text
    best = client.completions.create(model=M, prompt=ids, max_tokens=2, temperature=1.0, seed=5, n=1, best_of=3,
                                     echo=True)
    assert len(best.choices) == 1 and best.choices[0].text.startswith(text)
    streamed = client.completions.create(model=M, prompt=ids, max_tokens=2, temperature=1.0, seed=5, n=2, echo=True,
                                         stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(t.startswith(text) and len(t) > len(text) for t in texts)


def test_chat_prompt_logprobs_score_the_templated_prompt(served):
    """vLLM's chat extension: `prompt_logprobs` at the top of the response (and in the first stream
    chunk), for the prompt as the chat template wrote it; equal to the completions route's for the
    same token ids."""
    import httpx

    client, model = served
    url = str(client.base_url).rstrip("/")
    body = {"model": M, "messages": [{"role": "user", "content": "The sky is"}], "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}
    chat = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
    pl = chat["prompt_logprobs"]
    ids = httpx.post(f"{url.removesuffix('/v1')}/tokenize", json={"model": M, "messages": body["messages"]},
                     timeout=60).json()["tokens"]
    assert pl[0] is None and len(pl) == len(ids) == chat["usage"]["prompt_tokens"]
    want = reference(model, ids)
    for j, entry in enumerate(pl[1:], start=1):
        assert math.isclose(entry[str(ids[j])]["logprob"], want[j - 1], abs_tol=1e-4) and 1 <= len(entry) <= 3
    with httpx.stream("POST", f"{url}/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_logprobs"] == pl and not any("prompt_logprobs" in c for c in chunks[1:])
