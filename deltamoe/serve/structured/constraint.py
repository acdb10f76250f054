"""Constraint: one grammar a request's output must match, and its compilation in bounded time.

Every kind of structured output (a JSON schema, any JSON object, a regex, a choice of strings, a
Lark grammar, a tool-call section) becomes one llguidance grammar string; `compile` turns it into
a matcher prototype for a tokenizer. Compilation runs under llguidance's resource limits and a
wall-clock bound (COMPILE_TIMEOUT_S): a schema too big or too slow to compile is a RequestError
naming the client's field, never a hang. Prototypes are cached per (tokenizer, grammar), so the
same schema sent again costs a copy, not a compile.
"""

from __future__ import annotations

import json
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

import llguidance

from deltamoe.errors import RequestError
from deltamoe.serve.structured.tokenizer import ll_tokenizer
from deltamoe.tokenizers.base import Tokenizer

COMPILE_TIMEOUT_S = 10.0
MAX_GRAMMAR_CHARS = 1_000_000  # a schema larger than this is refused before any work
CACHE_SIZE = 64
# Tighter than llguidance's defaults: a request's grammar must compile in well under a second.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_grammar_size=200_000)
# JSON with at most one space where JSON allows whitespace: both the compact form and the one most
# training data writes (json.dumps' `{"a": 1, "b": 2}`) are allowed, so a model keeps to the form it
# learned (forcing compact JSON drove a model taught the spaced form into junk strings); unbounded
# whitespace (vLLM's default) would let a model wander in blank space until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}

# llguidance recurses once per rule or $ref link it follows: a 3,000-link chain (100 KB) overflowed an
# 8 MiB thread stack and took the server down. 256 MiB compiles 80,000 chained rules, more than
# MAX_GRAMMAR_CHARS can spell (only touched pages are committed, so the reservation costs address space).
COMPILE_STACK_BYTES = 256 << 20


class BigStackPool:
    """A few daemon worker threads with a `stack_bytes` stack (concurrent.futures' pool has no such option)."""

    def __init__(self, workers: int, stack_bytes: int, name: str):
        self.workers, self.stack_bytes, self.name = workers, stack_bytes, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        self._start()
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            previous = threading.stack_size(self.stack_bytes)  # for the threads made here
            try:
                for i in range(self.workers):
                    threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True).start()
            finally:
                threading.stack_size(previous)
            self._started = True

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter, as concurrent.futures does
                future.set_exception(e)


_pool = BigStackPool(workers=2, stack_bytes=COMPILE_STACK_BYTES, name="grammar-compile")
_cache: OrderedDict[tuple[int, str], llguidance.LLMatcher] = OrderedDict()
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class Constraint:
    """A grammar (llguidance's format) and the request field it came from (named in errors)."""

    grammar: str
    field: str
    # A text after which the grammar starts (None: from the first token): `</think>` when the model
    # reasons first. It must end on a token boundary, as a special token or byte-level tokens do.
    after: str | None = None
    # Texts that, written before `after`, start the grammar at themselves (their tokens are the
    # grammar's first): the tool-call section begin of a forced tool call, as Kimi models may call a
    # tool straight from their reasoning.
    enters_at: tuple[str, ...] = ()
    # Texts the output may not write before `after` (the reasoning parser ends reasoning at them, so
    # they would bypass the grammar): the tool-call section begins when the answer must be JSON.
    # Blocked where the text is one token (a special token) or its last character completes it.
    blocked_before: tuple[str, ...] = ()

    def compile(self, tokenizer: Tokenizer, timeout_s: float = COMPILE_TIMEOUT_S) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (the compiled prototype is cached and copied)."""
        ll = ll_tokenizer(tokenizer)
        key = (id(ll), self.grammar)
        with _cache_lock:
            proto = _cache.get(key)
            if proto is not None:
                _cache.move_to_end(key)
        if proto is None:
            proto = compile_grammar(ll, self.grammar, self.field, timeout_s)
            with _cache_lock:
                _cache[key] = proto
                while len(_cache) > CACHE_SIZE:
                    _cache.popitem(last=False)
        return proto.deep_copy()


def compile_pool() -> BigStackPool:
    """The threads grammars are built and compiled on (large stacks)."""
    return _pool


def compile_grammar(ll: llguidance.LLTokenizer, grammar: str, field: str,
                    timeout_s: float = COMPILE_TIMEOUT_S) -> llguidance.LLMatcher:
    """Validate and build a matcher; any failure or overrun is a RequestError naming `field`."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise RequestError(f"the grammar is {len(grammar)} characters; the limit is {MAX_GRAMMAR_CHARS}", field=field)
    limits = llguidance.LLParserLimits(**LIMITS)

    def build() -> llguidance.LLMatcher:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll, limits=limits)
        if is_error:
            raise RequestError(f"cannot be compiled: {_one_line(messages[0])}", field=field)
        return llguidance.LLMatcher(ll, grammar, log_level=0, limits=limits)

    future = _pool.submit(build)
    try:
        matcher = future.result(timeout=timeout_s)
    except FutureTimeout:
        # The worker finishes on its own (llguidance's fuel limits bound it); the request does not wait.
        raise RequestError(f"the grammar did not compile within {timeout_s:g} s; simplify it", field=field) from None
    if matcher.is_error():
        raise RequestError(f"cannot be compiled: {_one_line(matcher.get_error())}", field=field)
    return matcher


def _one_line(message: str) -> str:
    """The error on one line: llguidance's messages span lines ("regex parse error:" then the pattern
    and a caret), and the first alone says nothing."""
    return " ".join(message.split())[:500] or "unknown error"


# ---------------------------------------------------------------------------- grammar builders
def json_schema_constraint(schema: Any, field: str, strict: bool = True) -> Constraint:
    """Output is JSON valid against `schema`. Not strict: keywords llguidance does not implement are ignored."""
    if schema is False or schema == {"not": {}}:  # llguidance drops `not` when not strict: it would admit anything
        raise RequestError("this schema admits no value (false), so no output can match it", field=field)
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise RequestError(f"expected a JSON schema object, got {type(schema).__name__}", field=field)
    check_schema(schema, field)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=JSON_OPTIONS, overrides=None if strict else {"lenient": True})
    except (ValueError, TypeError, RuntimeError) as e:
        raise RequestError(f"cannot be compiled: {_one_line(str(e))}", field=field) from e
    # The grammar's own errors (a $ref to nowhere, a pattern that does not parse) named by this field
    # now, not by whichever field later compiles a grammar made of several (a forced tool call).
    try:
        is_error, messages = on_compile_thread(llguidance.LLMatcher.validate_grammar_with_warnings, grammar)
    except FutureTimeout:
        raise RequestError(f"the schema did not check within {COMPILE_TIMEOUT_S:g} s; simplify it", field=field) from None
    if is_error:
        raise RequestError(f"cannot be compiled: {_one_line(messages[0])}", field=field)
    return Constraint(grammar, field)


def on_compile_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on a big-stack compile thread: here when this is one, else there (waited for)."""
    if threading.current_thread().name.startswith(_pool.name):
        return fn(*args)
    return _pool.submit(fn, *args).result(timeout=COMPILE_TIMEOUT_S)


def check_schema(schema: dict, field: str) -> None:
    """A schema that is not itself valid JSON Schema (per its $schema draft, else 2020-12) is a 400."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise RequestError(f"not a valid JSON schema{f' at {where}' if where else ''}: {e.message}",
                           field=field) from None


def json_object_constraint(field: str) -> Constraint:
    return json_schema_constraint({"type": "object"}, field)


def regex_constraint(pattern: Any, field: str) -> Constraint:
    if not isinstance(pattern, str) or not pattern:
        raise RequestError("expected a non-empty regular expression string", field=field)
    return Constraint(llguidance.LLMatcher.grammar_from_regex(pattern), field)


def choice_constraint(choices: Any, field: str) -> Constraint:
    """Output is exactly one of `choices`."""
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise RequestError("expected a non-empty list of non-empty strings", field=field)
    return lark_constraint("start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices)), field)


def lark_constraint(grammar: Any, field: str) -> Constraint:
    if not isinstance(grammar, str) or not grammar.strip():
        raise RequestError("expected a non-empty Lark grammar string", field=field)
    return Constraint(llguidance.LLMatcher.grammar_from_lark(grammar), field)
