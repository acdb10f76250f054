"""Tool calls and reasoning end to end: a tiny model that has learned one Kimi-format answer, served,
and read back through the official `openai` client, whole and streamed.

Random weights never write a tool-call section, so the fixture teaches a tiny model one answer for
one prompt (a few dozen steps of plain cross-entropy until every next token is the argmax): some
reasoning, `</think>`, a sentence and two calls. Greedy decoding then writes exactly that text, and
everything after it (the server's parsers, the SSE stream, the SDK's objects) is the real path.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.serve.api.chat_template import ChatTemplate
from deltamoe.serve.api.server import build_app
from deltamoe.serve.api.thread import ServerThread
from deltamoe.serve.engine.async_engine import AsyncLLMEngine
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.tokenizers.byte import ByteTokenizer

pytestmark = pytest.mark.slow  # teaches a model first: ~30 s on a loaded 2-core machine
MODEL = "tiny-tools"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "Paris and Rome?"}]
THINK = {"thinking": True}
REASONING, CONTENT = "Two cities.", "Checking."
ARGS = ['{"city": "Paris"}', '{"city": "Rome"}']
ANSWER = (REASONING + "</think>" + CONTENT + "<|tool_calls_section_begin|>"
          + "".join(f"<|tool_call_begin|>functions.get_weather:{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
                    for i, a in enumerate(ARGS)) + "<|tool_calls_section_end|>")


def memorize(model, prompt: list[int], answer: list[int], max_steps: int = 300) -> None:
    """Train until greedy decoding of `prompt` gives `answer` (every next token the argmax)."""
    ids = torch.tensor([prompt + answer])
    x, y = ids[:, :-1], ids[0, len(prompt):]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        logits = model(x).logits[0, len(prompt) - 1:]
        loss = torch.nn.functional.cross_entropy(logits, y)
        if loss.item() < 0.05 and bool((logits.argmax(-1) == y).all()):
            return
        opt.zero_grad()
        loss.backward()
        opt.step()
    raise AssertionError(f"the model did not learn the answer in {max_steps} steps (loss {loss.item():.3f})")


@pytest.fixture(scope="module")
def server(tmp_path_factory, helpers):
    torch.manual_seed(0)
    template = ChatTemplate(ByteTokenizer())  # the checkpoint has no template: the server uses this default
    prompt = template.encode(MESSAGES, tools=TOOLS, template_kwargs=THINK)
    end = ByteTokenizer().special_tokens["<|end|>"]
    model = build_model(helpers.k31_tiny(), seed=0)
    memorize(model, prompt, list(ANSWER.encode()) + [end])
    folder = tmp_path_factory.mktemp("tools-ckpt")
    save_checkpoint(model.eval(), folder)
    config = EngineConfig(cache_memory="32MiB", max_model_len=512)
    engine = AsyncLLMEngine.from_pretrained(folder, config)
    offline = LLMEngine.from_pretrained(folder, config)
    with ServerThread(build_app(engine, MODEL)) as thread:
        client = openai.OpenAI(base_url=f"{thread.url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield SimpleNamespace(url=thread.url, client=client, template=template, offline=offline, prompt=prompt)


def chat(server, **kw):
    kw = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 300, **kw}
    extra = {"chat_template_kwargs": THINK, **kw.pop("extra_body", {})}
    return server.client.chat.completions.create(extra_body=extra, **kw)


def test_tool_calls_and_reasoning_in_one_response(server):
    r = chat(server)
    m, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert m.content == CONTENT and m.model_extra["reasoning_content"] == REASONING
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in m.tool_calls] == [
        (f"functions.get_weather:{i}", "function", "get_weather", a) for i, a in enumerate(ARGS)]
    # Reasoning tokens: those up to and including the one that closes the section (bytes here).
    assert r.usage.completion_tokens_details.reasoning_tokens == len((REASONING + "</think>").encode())
    assert r.usage.completion_tokens == len(ANSWER.encode()) + 1  # + the end-of-turn token that stopped it


def test_streamed_deltas_add_up_to_the_response(server):
    whole = chat(server).choices[0].message
    chunks = list(chat(server, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    reasoning = content = ""
    calls: dict[int, dict] = {}
    for c in chunks[:-1]:
        d = c.choices[0].delta
        reasoning += d.model_extra.get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:  # accumulated the way OpenAI clients do, keyed by index
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
    assert (reasoning, content) == (REASONING, CONTENT)
    assert [calls[i] for i in sorted(calls)] == [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in whole.tool_calls]
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert all(c.usage is not None for c in chunks)  # continuous_usage_stats
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len((REASONING + "</think>").encode())


def test_parallel_tool_calls_false_keeps_the_first(server):
    m = chat(server, parallel_tool_calls=False).choices[0].message
    assert [c.function.arguments for c in m.tool_calls] == ARGS[:1]


def test_tool_choice_none_leaves_the_text_as_content(server):
    r = chat(server, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ANSWER[len(REASONING + "</think>"):]  # reasoning still parsed


def test_thinking_off_is_plain_content(server):
    prompt = server.template.encode(MESSAGES, tools=TOOLS, template_kwargs={"thinking": False})
    assert prompt == server.prompt[:-len(b"<think>")]  # the template opens no section
    ref = server.offline.generate([prompt], SamplingParams(max_tokens=40, temperature=0,
                                                           stop_token_ids=server.template.stop_token_ids),
                                  progress=False)[0]
    r = chat(server, tool_choice="none", max_tokens=40, extra_body={"chat_template_kwargs": {"thinking": False}})
    m = r.choices[0].message
    assert m.content == ref.text and m.model_extra["reasoning_content"] is None
    assert r.usage.completion_tokens_details is None


def test_the_calls_go_back_into_the_conversation(server):
    first = chat(server).choices[0].message
    history = MESSAGES + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"sky": "clear"})} for c in first.tool_calls]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": history, "tools": TOOLS,
                                                      "chat_template_kwargs": THINK}).json()["tokens"]
    text = ByteTokenizer().decode(ids, skip_special_tokens=False)
    assert "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>" + ARGS[1] in text
    assert '<|tool|>## Return of functions.get_weather:0\n{"sky": "clear"}<|end|>' in text
    assert ids == server.template.encode(history, tools=TOOLS, template_kwargs=THINK)


def test_n_choices_sum_their_reasoning_tokens(server):
    """Usage over n choices: completion tokens and reasoning tokens both summed (greedy: n equal ones)."""
    one = chat(server).usage.completion_tokens_details.reasoning_tokens
    r = chat(server, n=2)
    assert len(r.choices) == 2 and r.usage.completion_tokens_details.reasoning_tokens == 2 * one
