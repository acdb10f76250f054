"""Chat formatting and the AsyncLLMEngine front (streaming deltas, cancellation frees memory)."""

from __future__ import annotations

import asyncio
import json

import pytest

from deltamoe.errors import RequestError
from deltamoe.serve.api.chat_template import ChatTemplate
from deltamoe.serve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.tokenizers.byte import ByteTokenizer
from deltamoe.tokenizers.load import load_tokenizer


def test_default_template_uses_byte_specials():
    tok = ByteTokenizer()
    t = ChatTemplate.for_model(tok, None)
    sp = tok.special_tokens
    ids = t.encode([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|end|>"}])
    assert ids == ([sp["<|system|>"], *b"be brief", sp["<|end|>"], sp["<|user|>"], *b"hi <|end|>", sp["<|end|>"],
                    sp["<|assistant|>"]])  # '<|end|>' typed by the user stays bytes
    assert sp["<|end|>"] in t.stop_token_ids and tok.eos_token_id in t.stop_token_ids
    parts = t.encode([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parts[1:3] == [ord("a"), ord("b")]


def test_checkpoint_template_wins(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}<|end|>{% endfor %}"}))
    tok = ByteTokenizer()
    t = ChatTemplate.for_model(tok, tmp_path)
    assert t.render([{"role": "user", "content": "x"}]) == "[user]x<|end|>"
    assert t.encode([{"role": "user", "content": "x"}]) == [*b"[user]x", tok.special_tokens["<|end|>"]]


@pytest.mark.parametrize("messages,field", [
    ([], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(RequestError) as e:
        ChatTemplate(ByteTokenizer()).encode(messages)
    assert e.value.field == field


async def collect(engine: AsyncLLMEngine, prompt, params, **kw):
    outs = [o async for o in engine.generate(prompt, params, **kw)]
    return outs


def test_async_streams_match_the_sync_engine(k31_model, helpers):
    ps = helpers.prompts(5, 3, 30, seed=8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB")).generate(ps, params, progress=False)
    engine = AsyncLLMEngine(LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB")))

    async def main():
        return await asyncio.gather(*(collect(engine, p, params) for p in ps))

    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    for outs, exp in zip(streams, expected):
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert [t for o in outs for t in o.delta_token_ids] == exp.token_ids
        assert "".join(o.delta_text for o in outs) == outs[-1].text == exp.text
    assert engine.stats().requests_finished == 5


def test_async_cancel_aborts_and_frees(k31_model):
    engine = AsyncLLMEngine(LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB")))
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main():
        seen = []

        async def consume():
            async for out in engine.generate([1, 2, 3], params, request_id="long"):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        task.cancel()  # what a client disconnect does to the server's handler
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            s = engine.stats()
            if s.num_running == 0 and s.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(RequestError):  # validated in the caller, before anything is queued
            async for _ in engine.generate("", params):
                pass
        return seen, engine.stats()

    try:
        seen, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert 3 <= len(seen) < 400
    assert (stats.num_running, stats.block_usage, stats.slot_usage) == (0, 0.0, 0.0)


def test_a_failed_step_ends_every_stream_and_frees_its_memory(k31_model, monkeypatch):
    """The engine thread survives a step that raises: each request in flight, running or still
    waiting, ends with EngineDeadError and gives its blocks and slot back (`LLMEngine.abort_all`)."""
    sync = LLMEngine(k31_model, config=EngineConfig(cache_memory="8MiB", max_num_seqs=1))
    engine = AsyncLLMEngine(sync)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    real_step = sync.step
    steps = 0

    def failing_step():
        nonlocal steps
        steps += 1
        if steps == 3:  # one request running (max_num_seqs=1), the other still waiting
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(sync, "step", failing_step)

    async def one(prompt):
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(engine, prompt, params)

    async def main():
        await asyncio.gather(one([1, 2, 3]), one([4, 5, 6]))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    stats = sync.stats()
    assert (stats.num_running, stats.num_waiting, stats.block_usage, stats.slot_usage) == (0, 0, 0.0, 0.0)
    assert sync.abort_all() == []
