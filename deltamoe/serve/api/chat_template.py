"""Chat formatting shared by `deltamoe chat` and the server: messages -> prompt token ids + stop ids.

The checkpoint's `tokenizer_config.json` `chat_template` (jinja2, rendered sandboxed as HF does)
wins when present. Otherwise the documented default for the byte tokenizer's specials:

    <|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{reply}<|end|>...<|assistant|>

and generation stops at `<|end|>` (or the template's turn terminator / EOS). Special-token
names that the template writes become their ids; message content is always encoded as plain
text, so a user typing '<|end|>' gets those bytes, never the special token.

Tools and thinking (Kimi's format, as its own templates write it): the template gets `tools`
(the request's definitions), assistant messages keep `tool_calls` (`id` `functions.NAME:IDX`,
`function.arguments` as a JSON string), tool messages keep `tool_call_id`, and the request's
`chat_template_kwargs` (e.g. `thinking`) are passed as template variables. The default
templates declare tools as JSON in a system turn and write calls as

    <|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>...
    <|tool_calls_section_end|>

and open a `<think>` section after the generation prompt when `thinking` is true. What a
client wrote (content, call ids and arguments, `tojson` output such as tool descriptions) is
plain text there too: it is rendered as a placeholder and encoded apart from the template's
own text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from jinja2 import pass_context

from deltamoe.errors import RequestError
from deltamoe.serve.api.images import expand_images
from deltamoe.serve.structured.tool_call import foreign_call_ids
from deltamoe.tokenizers.base import Tokenizer
from deltamoe.tokenizers.hf import token_name
from deltamoe.tokenizers.load import tokenizer_config

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system instructions (its SDKs send it)
# A message's body: a tool result names its call; an assistant's calls follow its content.
_BODY = (
    "{% if m.tool_call_id %}## Return of {{ m.tool_call_id }}\n{% endif %}{{ m.content }}"
    "{% if m.tool_calls %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}"
    "<|tool_call_argument_begin|>{{ c.function.arguments }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|>{% endif %}"
)
DEFAULT_TEMPLATE = (
    "{% if tools %}<|system|>tool_declare\n{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>" + _BODY + "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if thinking %}<think>{% endif %}{% endif %}"
)
PLAIN_TEMPLATE = (  # for a tokenizer without the byte specials and without a template of its own
    "{% if tools %}tool_declare: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: " + _BODY + "\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if thinking %}<think>{% endif %}{% endif %}"
)
PLAIN_MARK = "\x00{}\x00"  # a placeholder for client text in the rendered skeleton
_MARK_RE = re.compile("(\x00\\d+\x00)")
TURN_END_NAMES = ("<|end|>", "<|im_end|>", "<|eot_id|>", "<|end_of_msg|>")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI-style messages -> [{role, content: str, ...}]; content parts of type text (and an
    assistant's `refusal` parts) are joined; a `developer` message is a system message.

    An assistant message keeps its `tool_calls` (arguments as a JSON string), a tool message its
    `tool_call_id`, both with an id not in Kimi's form (OpenAI's `call_abc`) written as Kimi's
    `functions.NAME:K` (`structured.tool_call.history_call_ids`); other fields are dropped."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("expected a non-empty list of messages", field="messages")
    renamed = foreign_call_ids(messages)  # OpenAI-style call ids -> Kimi's functions.NAME:K, results too
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError("expected an object with role and content", field=f"messages[{i}]")
        role, content = m.get("role"), m.get("content")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise RequestError(f"expected one of {(*ROLES, *ROLE_ALIASES)}, got {m.get('role')!r}",
                               field=f"messages[{i}].role")
        if isinstance(content, list):
            if not all(_part_text(p, role) is not None for p in content):
                raise RequestError("expected content parts of type text (or image_url, for a model with a vision "
                                   "tower; refusal in an assistant message)", field=f"messages[{i}].content")
            content = "".join(_part_text(p, role) for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError("expected a string or a list of text parts", field=f"messages[{i}].content")
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = [{**c, "id": renamed.get(c["id"], c["id"])}
                                     for c in _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")]
        if role == "tool":
            # OpenAI refuses a tool result without the id of the call it answers (and the template
            # would render it as a result of nothing): required, as there.
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise RequestError("expected the id (a non-empty string) of the tool call this message answers",
                                   field=f"messages[{i}].tool_call_id")
            message["tool_call_id"] = renamed.get(m["tool_call_id"], m["tool_call_id"])
        out.append(message)
    return out


def _part_text(part: Any, role: str) -> str | None:
    """A content part's text: a text part's, or an assistant's refusal (OpenAI returns refusals as
    parts of that type, and agents send the history back as they got it); None for anything else."""
    if not isinstance(part, dict):
        return None
    key = {"text": "text", "refusal": "refusal" if role == "assistant" else None}.get(part.get("type"))
    return part.get(key) if key and isinstance(part.get(key), str) else None


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's calls as [{id, type, function: {name, arguments: JSON text}}]."""
    if not isinstance(calls, list):
        raise RequestError("expected a list of tool calls", field=where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(c.get("id"), str) or not isinstance(f.get("name"), str):
            raise RequestError("expected {id, type: 'function', function: {name, arguments}}", field=f"{where}[{j}]")
        arguments = f.get("arguments", "{}")
        if not isinstance(arguments, str):  # some clients send the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": arguments}})
    return out


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer, template: str | None = None, config: dict[str, Any] | None = None):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.tokenizer = tokenizer
        specials = tokenizer.special_tokens
        if template is None:
            template = DEFAULT_TEMPLATE if all(f"<|{r}|>" in specials for r in ("user", "assistant")) else PLAIN_TEMPLATE
        self.source = template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template)
        cfg = config or {}
        self._names = {"bos_token": token_name(cfg.get("bos_token")) or "", "eos_token": token_name(cfg.get("eos_token")) or ""}
        stop = {specials[n] for n in TURN_END_NAMES if n in specials}
        if tokenizer.eos_token_id is not None:
            stop.add(tokenizer.eos_token_id)
        self.stop_token_ids = sorted(stop)
        # A checkpoint template that writes <think> belongs to a thinking model: thinking is on unless
        # a request turns it off. The built-in templates open the section only when asked to.
        self.thinking_default = "<think>" in template and template not in (DEFAULT_TEMPLATE, PLAIN_TEMPLATE)
        self._specials = specials
        # Longest names first, so '<|im_end|>' is never split as a shorter special inside it.
        names = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, folder: str | Path | None) -> "ChatTemplate":
        """The folder's tokenizer_config.json template if it has one, else the default."""
        cfg = tokenizer_config(Path(folder)) if folder is not None and Path(folder).is_dir() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # HF's named-template form: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(tokenizer, template if isinstance(template, str) else None, cfg)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
               plain: list[str] | None = None) -> str:
        """The template's text. `plain`: a list that collects `tojson` output (placeholders in the text)."""
        variables = {**(template_kwargs or {}), **self._names}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     deltamoe_plain=plain, **variables)

    def encode(self, messages: Any, add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None, image_tokens: list[list[int]] | None = None,
               continue_final_message: bool = False) -> list[int]:
        """Token ids of the rendered conversation: specials the template writes become their ids.

        `continue_final_message` (vLLM's, HF's): the text ends where the last message's content does,
        without the turn's closing tokens, so that the output continues it (an assistant prefill).

        What the client wrote (content, tool-call ids and arguments, tool results' call ids,
        `tojson` output) is encoded as plain text on its own (a user typing '<|end|>' gets the
        bytes, not the special), by rendering with placeholders first. `image_tokens[k]` replaces
        the k-th image mark in the contents (`serve/api/images.py`).
        """
        plain: list[str] = []
        images = iter(image_tokens or [])

        def mark(text: str) -> str:
            if not text:  # nothing to protect, and an empty field stays falsy for the template's tests
                return text
            plain.append(text)
            return PLAIN_MARK.format(len(plain) - 1)

        marked = []
        for m in normalize_messages(messages):
            m = {**m, "content": mark(m["content"])}
            if "tool_call_id" in m:
                m["tool_call_id"] = mark(m["tool_call_id"])
            if "tool_calls" in m:
                m["tool_calls"] = [{**c, "id": mark(c["id"]),
                                    "function": {**c["function"], "arguments": mark(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            marked.append(m)
        skeleton = self.render(marked, add_generation_prompt, tools, template_kwargs, plain)
        if continue_final_message:
            skeleton = _cut_after_last_content(skeleton, marked[-1]["content"])
        ids: list[int] = []
        for piece in _MARK_RE.split(skeleton):
            if _MARK_RE.fullmatch(piece):
                ids += expand_images(self.tokenizer.encode, plain[int(piece[1:-1])], images)
            elif piece:
                ids += self._encode_with_specials(piece)
        if next(images, None) is not None:
            raise RequestError("more images than image parts in the messages", field="messages")
        return ids

    def _encode_with_specials(self, text: str) -> list[int]:
        if self._special_re is None:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids += self.tokenizer.encode(text[pos:m.start()]) if m.start() > pos else []
            ids.append(self._specials[m.group()])
            pos = m.end()
        return ids + (self.tokenizer.encode(text[pos:]) if pos < len(text) else [])


def _cut_after_last_content(skeleton: str, content_mark: str) -> str:
    """The rendered text up to the end of the last message's content (its placeholder)."""
    if not content_mark:
        raise RequestError("continue_final_message: the last message has no content to continue",
                           field="continue_final_message")
    end = skeleton.rfind(content_mark)
    if end < 0:  # a template that rewrites the content (strips it, say) leaves no mark to cut at
        raise RequestError("continue_final_message: the chat template does not write the last message's "
                           "content as sent, so the prompt cannot end inside it", field="continue_final_message")
    return skeleton[:end + len(content_mark)]


@pass_context
def _tojson(context: Any, value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's `tojson` (templates are written for it: no HTML escaping, `separators`), whose text is
    client data: while encoding, it becomes a placeholder so it is never read as specials."""
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    plain = context.get("deltamoe_plain")
    if plain is None:
        return text
    plain.append(text)
    return PLAIN_MARK.format(len(plain) - 1)


def _raise(message: str) -> None:
    raise RequestError(message, field="messages")
