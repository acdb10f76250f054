"""Structured outputs in the engine: every output of a constrained request parses and validates,
whatever the (random) weights, in a batch, under preemption and with an HF tokenizer; bad schemas
are RequestErrors naming the field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from deltamoe.errors import RequestError
from deltamoe.model.load import build_model
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.structured.constraint import (choice_constraint, compile_grammar, json_object_constraint,
                                                  json_schema_constraint, regex_constraint)
from deltamoe.serve.structured.tokenizer import ll_tokenizer
from deltamoe.serve.structured.tool_call import tool_call_constraint

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random bounded schema: generation can always finish within a few hundred tokens."""
    # No "number": its digits are unbounded, so random weights (greedy most of all) can run to max_tokens.
    kinds = ["string", "integer", "boolean", "null", "enum"] + (["object", "array", "anyOf"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
        required = [k for k in props if rng.random() < 0.7]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(2)]}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "enum":
        return {"enum": rng.sample(["x", "yes", 3, None, True, "zz"], rng.randint(1, 3))}
    return {"type": kind}


def check_json(completions, schemas) -> None:
    for c, schema in zip(completions, schemas):
        assert c.finish_reason == "stop", (c.text, schema)
        jsonschema.validate(json.loads(c.text), schema)


@pytest.fixture(scope="module")
def engine(k31_model):
    return LLMEngine(k31_model, config=EngineConfig(cache_memory="16MiB", max_model_len=512))


def constrained(schema, temperature=1.0, seed=0, max_tokens=400):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured=json_schema_constraint(schema, "response_format"))


def test_json_schema_outputs_validate_in_a_mixed_batch(engine):
    """Constrained rows (greedy and sampled, fixed and random schemas) beside free ones: the
    constrained outputs validate, the free ones are what they are alone."""
    rng = random.Random(0)
    schemas = [PERSON, PERSON] + [random_schema(rng) for _ in range(6)]
    params = [constrained(s, temperature=0.0 if i == 0 else 1.0, seed=i) for i, s in enumerate(schemas)]
    free = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
    out = engine.generate(["hello"] * len(params) + ["free"], params + [free], progress=False)
    check_json(out[:-1], schemas)
    alone = engine.generate(["free"], free, progress=False)[0]
    assert out[-1].token_ids == alone.token_ids


def test_regex_and_choice(engine):
    params = [SamplingParams(max_tokens=50, temperature=1.0, seed=s, structured=c) for s, c in enumerate([
        regex_constraint(r"[0-9]{3}-[a-z]{2,4}", "guided_regex"), choice_constraint(["yes", "no", "maybe so"], "guided_choice")])]
    rx, choice = engine.generate(["b", "c"], params, progress=False)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", rx.text) and rx.finish_reason == "stop"
    assert choice.text in ("yes", "no", "maybe so") and choice.finish_reason == "stop"


def test_json_object_grammar(engine):
    """Any JSON object, and nothing else (generating one with random weights takes ~300 tokens: the slow test)."""
    matcher = json_object_constraint("response_format").compile(engine.tokenizer)
    ok = engine.tokenizer.encode('{"a":[1,{"b":null}],"c":"d"}')
    assert matcher.validate_tokens(ok) == len(ok)
    assert matcher.validate_tokens(engine.tokenizer.encode("[1]")) == 0


@pytest.mark.slow
def test_json_object_generation(engine):
    out = engine.generate(["a"] * 2, [SamplingParams(max_tokens=None, temperature=1.0, seed=s, structured=json_object_constraint(
        "response_format")) for s in range(2)], progress=False)
    for o in out:
        assert o.finish_reason == "stop" and isinstance(json.loads(o.text), dict)


@pytest.mark.slow
def test_many_random_schemas(engine):
    rng = random.Random(123)
    schemas = [random_schema(rng) for _ in range(200)]
    for i in range(0, len(schemas), 25):
        chunk = schemas[i:i + 25]
        out = engine.generate(["x"] * len(chunk), [constrained(s, temperature=[0.0, 0.7, 1.0][j % 3], seed=i + j)
                                                   for j, s in enumerate(chunk)], progress=False)
        check_json(out, chunk)


def test_preemption_keeps_the_grammar(k31_model):
    """A cache of a few blocks: sequences are preempted and recomputed; their matchers, kept on the
    Sequence, continue where they were, so the outputs still validate."""
    engine = LLMEngine(k31_model, config=EngineConfig(cache_memory=40_000, max_num_batched_tokens=64))
    schemas = [PERSON] * 8  # at most ~55 bytes of JSON: fits the ~110 tokens a sequence may hold here
    out = engine.generate([[1] * 20] * len(schemas), [constrained(s, seed=i, max_tokens=90)
                                                      for i, s in enumerate(schemas)], progress=False)
    assert engine.stats().num_preemptions > 0
    check_json(out, schemas)


def test_hf_tokenizer(tmp_path, helpers):
    """A byte-level BPE tokenizer.json with multi-byte tokens and a special EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from deltamoe.tokenizers.hf import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['{"name": "bob", "age": 12}', "hello world"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json", {"eos_token": "<|endoftext|>"})
    model = build_model(helpers.k31_tiny(vocab_size=320), seed=4).eval()
    engine = LLMEngine(model, hf, EngineConfig(cache_memory="16MiB", max_model_len=512))
    out = engine.generate(["hello"] * 2, [constrained(PERSON, seed=i) for i in range(2)], progress=False)
    check_json(out, [PERSON] * 2)
    assert any(len(hf.token_bytes(t)) > 1 for c in out for t in c.token_ids)  # merged tokens were used


def test_tool_call_section(engine):
    """tool_choice 'required' / named: a Kimi tool-call section whose arguments validate."""
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
               "required": ["city"], "additionalProperties": False}
    noop = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "noop", "parameters": noop}}]
    call = re.compile(r"<\|tool_call_begin\|>functions\.(\w+):\d+<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>")
    named = {"type": "function", "function": {"name": "get_weather"}}
    params = [SamplingParams(max_tokens=None, temperature=1.0, seed=s, structured=tool_call_constraint(
        tools, choice, False, engine.tokenizer)) for s, choice in enumerate(["required", named])]
    for o, choice in zip(engine.generate(["call"] * 2, params, progress=False), ["required", named]):
        assert o.finish_reason == "stop"
        assert o.text.startswith("<|tool_calls_section_begin|>") and o.text.endswith("<|tool_calls_section_end|>")
        (name, args), = call.findall(o.text)
        assert choice == "required" or name == "get_weather"
        jsonschema.validate(json.loads(args), weather if name == "get_weather" else noop)
    # Parallel calls: a section of two calls is accepted whole; an argument off its schema is not.
    two = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.noop:0<|tool_call_argument_begin|>{}'
           '<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city":"Oslo"}'
           '<|tool_call_end|><|tool_calls_section_end|>')
    matcher = tool_call_constraint(tools, "required", True, engine.tokenizer).compile(engine.tokenizer)
    ids = engine.tokenizer.encode(two)
    assert matcher.validate_tokens(ids) == len(ids)
    bad = engine.tokenizer.encode(two.replace('"Oslo"', "7"))
    assert matcher.validate_tokens(bad) < len(bad)


@pytest.mark.parametrize("make, field", [
    (lambda: json_schema_constraint({"type": "objectx"}, "response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (lambda: json_schema_constraint({"type": "string", "minLength": -1}, "guided_json"), "guided_json"),
    (lambda: json_schema_constraint([1], "guided_json"), "guided_json"),
    (lambda: regex_constraint("", "guided_regex"), "guided_regex"),
    (lambda: choice_constraint([], "guided_choice"), "guided_choice"),
    (lambda: tool_call_constraint([{"type": "function", "function": {"name": "f"}}],
                                  {"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (lambda: tool_call_constraint([{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
                                  "required"), "tools[0].function.parameters"),
    (lambda: tool_call_constraint([{"type": "function", "function": {"name": "f"}},  # a $ref to nowhere
                                   {"type": "function", "function": {"name": "g", "parameters": {
                                       "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}],
                                  "required"), "tools[1].function.parameters"),
])
def test_bad_constraints_name_the_field(make, field):
    with pytest.raises(RequestError) as e:
        make()
    assert e.value.field == field


def test_compile_errors_and_time_bound(engine, monkeypatch):
    with pytest.raises(RequestError, match="cannot be compiled") as e:
        regex_constraint("(unclosed", "guided_regex").compile(engine.tokenizer)
    assert e.value.field == "guided_regex"
    # A compile that overruns its bound is a RequestError at the bound, not a wait for the compile.
    import time

    from deltamoe.serve.structured import constraint

    real = constraint.llguidance.LLMatcher

    class SlowMatcher:
        validate_grammar_with_warnings = staticmethod(real.validate_grammar_with_warnings)

        def __new__(cls, *args, **kwargs):
            time.sleep(1.0)
            return real(*args, **kwargs)

    grammar = json_schema_constraint(PERSON, "guided_json").grammar
    monkeypatch.setattr(constraint.llguidance, "LLMatcher", SlowMatcher)
    start = time.perf_counter()
    with pytest.raises(RequestError, match="did not compile within") as e:
        compile_grammar(ll_tokenizer(engine.tokenizer), grammar, "guided_json", timeout_s=0.1)
    assert e.value.field == "guided_json" and time.perf_counter() - start < 0.9


def test_a_constraint_after_the_reasoning_leaves_the_reasoning_free():
    """With `after="</think>"` (a chat whose model reasons first) every token is allowed until the output
    has written `</think>`; from the next token on, the grammar's mask and nothing else."""
    import dataclasses

    import torch

    from deltamoe.serve.structured.matcher import GrammarMatcher
    from deltamoe.tokenizers.load import load_tokenizer

    tok = load_tokenizer(None, 264)
    constraint = dataclasses.replace(choice_constraint(["yes", "no"], "structured_outputs.choice"), after="</think>")
    free, plain = (GrammarMatcher(c, tok, 264, frozenset({tok.eos_token_id}))
                   for c in (constraint, dataclasses.replace(constraint, after=None)))
    for token in tok.encode("no </thin> yet, then </think>"):
        assert bool(free.allowed().all()) and not free.done
        free.accept(token)
    assert torch.equal(free.allowed(), plain.allowed()) and not bool(free.allowed().all())
    for token in tok.encode("yes"):
        assert bool(free.allowed()[token])
        free.accept(token)
    assert free.done


def test_a_forced_call_of_a_tool_whose_schema_has_no_type_writes_an_object():
    """`parameters: {"properties": ...}` without `type`: the arguments are still an object."""
    from deltamoe.serve.structured.tool_call import _functions

    schema = _functions([{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"x": {"type": "integer"}}}}}])["f"]
    assert schema["type"] == "object" and schema["properties"] == {"x": {"type": "integer"}}


def _matchers(constraint, text_before: str):
    """A matcher for `reasoning_first(constraint)` fed `text_before`, and a plain one for `constraint`."""
    from deltamoe.serve.api.reasoning_parser import reasoning_first
    from deltamoe.serve.structured.matcher import GrammarMatcher
    from deltamoe.tokenizers.load import load_tokenizer

    tok = load_tokenizer(None, 264)
    gated, plain = (GrammarMatcher(c, tok, 264, frozenset({tok.eos_token_id}))
                    for c in (reasoning_first(constraint), constraint))
    for token in tok.encode(text_before):
        gated.accept(token)
    return tok, gated, plain


WEATHER_AND_FLIGHT = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for n in ("get_weather", "book_flight")]


def test_a_forced_call_begun_inside_the_reasoning_is_still_the_forced_call():
    """Kimi models may open a tool-call section straight from their reasoning (the reasoning parser
    ends reasoning there). With a named tool_choice the grammar starts at that section begin, so the
    call written is the named function's, with its schema, not whatever the reasoning went on to."""
    import torch

    constraint = tool_call_constraint(WEATHER_AND_FLIGHT, {"type": "function", "function": {"name": "book_flight"}})
    tok, gated, plain = _matchers(constraint, "Two cities.<|tool_calls_section_begin|>")
    for token in tok.encode("<|tool_calls_section_begin|>"):
        plain.accept(token)
    assert torch.equal(gated.allowed(), plain.allowed()) and not bool(gated.allowed().all())
    for token in tok.encode("<|tool_call_begin|>functions."):
        gated.accept(token)
    allowed = gated.allowed()
    assert bool(allowed[ord("b")]) and not bool(allowed[ord("g")])  # book_flight, never get_weather
    for token in tok.encode('book_flight:0<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|>'
                            '<|tool_calls_section_end|>'):
        assert bool(gated.allowed()[token])
        gated.accept(token)
    assert gated.done and gated.failed is None


@pytest.mark.parametrize("make, section", [
    (lambda: json_schema_constraint(PERSON, "response_format"), "<|tool_calls_section_begin|>"),
    (lambda: json_schema_constraint(PERSON, "response_format"), "<|tool_call_section_begin|>"),
    (lambda: tool_call_constraint(WEATHER_AND_FLIGHT, "required"), "<|tool_call_section_begin|>"),
])
def test_reasoning_may_not_begin_a_section_that_would_bypass_the_grammar(make, section):
    """An answer held to a JSON schema is not a tool-call section, so the reasoning may not begin one
    (the reasoning parser would end reasoning there and the grammar would never run); the same for the
    singular spelling under a forced call, whose grammar writes the plural one."""
    tok, gated, _ = _matchers(make(), "Thinking." + section[:-1])
    allowed = gated.allowed()
    assert not bool(allowed[ord(">")]) and int((~allowed).sum()) == 1  # only the character that would finish it
    gated.accept(ord("x"))
    assert bool(gated.allowed().all())  # elsewhere the reasoning is free
