"""Chat formatting shared by `deltamoe chat` and the server: messages -> prompt token ids + stop ids.

The checkpoint's `tokenizer_config.json` `chat_template` (jinja2, rendered sandboxed as HF does)
wins when present. Otherwise the documented default for the byte tokenizer's specials:

    <|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{reply}<|end|>...<|assistant|>

and generation stops at `<|end|>` (or the template's turn terminator / EOS). Special-token
names that the template writes become their ids; message content is always encoded as plain
text, so a user typing '<|end|>' gets those bytes, never the special token.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from deltamoe.errors import RequestError
from deltamoe.serve.api.images import expand_images
from deltamoe.tokenizers.base import Tokenizer
from deltamoe.tokenizers.hf import token_name
from deltamoe.tokenizers.load import tokenizer_config

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PLAIN_TEMPLATE = (  # for a tokenizer without the byte specials and without a template of its own
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TURN_END_NAMES = ("<|end|>", "<|im_end|>", "<|eot_id|>", "<|end_of_msg|>")


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI-style messages -> [{role, content: str}]; content parts of type text are joined."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("expected a non-empty list of messages", field="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError("expected an object with role and content", field=f"messages[{i}]")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RequestError(f"expected one of {ROLES}, got {role!r}", field=f"messages[{i}].role")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise RequestError("only text content parts are supported", field=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError("expected a string or a list of text parts", field=f"messages[{i}].content")
        out.append({"role": role, "content": content})
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
        self._template = env.from_string(template)
        cfg = config or {}
        self._names = {"bos_token": token_name(cfg.get("bos_token")) or "", "eos_token": token_name(cfg.get("eos_token")) or ""}
        stop = {specials[n] for n in TURN_END_NAMES if n in specials}
        if tokenizer.eos_token_id is not None:
            stop.add(tokenizer.eos_token_id)
        self.stop_token_ids = sorted(stop)
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

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._names)

    def encode(self, messages: Any, add_generation_prompt: bool = True,
               image_tokens: list[list[int]] | None = None) -> list[int]:
        """Token ids of the rendered conversation: specials the template writes become their ids.

        Each message's content is encoded as plain text on its own (a user typing '<|end|>' gets the
        bytes, not the special), by rendering with placeholders first. `image_tokens[k]` replaces
        the k-th image mark in the contents (`serve/api/images.py`).
        """
        images = iter(image_tokens or [])
        messages = normalize_messages(messages)
        marks = [f"\x00{i}\x00" for i in range(len(messages))]
        skeleton = self.render([{**m, "content": mark} for m, mark in zip(messages, marks)], add_generation_prompt)
        ids: list[int] = []
        for piece in re.split("(\x00\\d+\x00)", skeleton):
            if piece in marks:
                ids += expand_images(self.tokenizer.encode, messages[marks.index(piece)]["content"], images)
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


def _raise(message: str) -> None:
    raise RequestError(message, field="messages")
