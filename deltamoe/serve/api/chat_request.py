"""What a chat request asks of the template and of the output parsing: tools, thinking, template kwargs.

`ChatOptions.of(request, template)` checks `tools` / `tool_choice` / `parallel_tool_calls` and
`chat_template_kwargs` (errors name the field); `parser(...)` builds the choice's output parser
once the prompt is rendered (the prompt tells whether the template already opened `<think>`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltamoe.config import ModelConfig
from deltamoe.errors import RequestError
from deltamoe.serve.api.chat_output import ChatChoiceParser
from deltamoe.serve.api.chat_template import ChatTemplate
from deltamoe.serve.api.errors import APIError
from deltamoe.serve.api.images import ImageOptions, extract_images, load_images
from deltamoe.serve.api.reasoning_parser import THINK_BEGIN, THINK_END, ReasoningParser
from deltamoe.serve.api.schemas import ChatCompletionRequest, TokenizeRequest
from deltamoe.serve.api.tool_parser import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, \
    ToolCallParser
from deltamoe.serve.api.tool_request import ToolRequest, tool_request
from deltamoe.serve.engine.sampling import SamplingParams
from deltamoe.serve.structured.tool_call import history_call_ids
from deltamoe.tokenizers.base import Tokenizer
from deltamoe.vision.preprocess import PreparedImage

MARKERS = (THINK_BEGIN, THINK_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, *SECTION_BEGIN, *SECTION_END)
# Variables the server itself passes to the template; a request may not override them.
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "deltamoe_plain",
                   "raise_exception")


@dataclass(frozen=True)
class ChatOptions:
    tools: ToolRequest
    thinking: bool
    template_kwargs: dict[str, Any]
    continue_final_message: bool = False  # the prompt ends inside the last message, which the output continues
    history_call_ids: frozenset[str] = frozenset()  # the conversation's tool-call ids: new calls get others

    @classmethod
    def of(cls, req: ChatCompletionRequest | TokenizeRequest, template: ChatTemplate) -> "ChatOptions":
        tools = tool_request(req.tools, getattr(req, "tool_choice", None), getattr(req, "parallel_tool_calls", None))
        kwargs = dict(req.chat_template_kwargs or {})
        for name in RESERVED_KWARGS:
            if name in kwargs:
                raise APIError(400, f"chat_template_kwargs.{name}: set by the server, not by a request",
                               param=f"chat_template_kwargs.{name}", code="invalid_value")
        thinking = kwargs.get("thinking", template.thinking_default)
        if not isinstance(thinking, bool):
            raise APIError(400, f"chat_template_kwargs.thinking: expected true or false, got {thinking!r}",
                           param="chat_template_kwargs.thinking", code="invalid_value")
        kwargs["thinking"] = thinking
        continue_final = bool(getattr(req, "continue_final_message", False))
        if continue_final and req.add_generation_prompt:
            raise APIError(400, "continue_final_message: continues the last message, so it needs "
                           "add_generation_prompt: false (a new assistant turn would follow it otherwise)",
                           param="continue_final_message", code="invalid_value")
        return cls(tools, thinking, kwargs, continue_final, frozenset(history_call_ids(req.messages or [])))

    def encode(self, template: ChatTemplate, messages: list[dict[str, Any]], add_generation_prompt: bool,
               image_tokens: list[list[int]] | None = None) -> list[int]:
        """The prompt's token ids, with the request's tools and template kwargs; `messages` as dicts
        (`model_dump()`); `image_tokens`: each image's placeholder ids, in the order of the messages'
        image marks (`serve/api/images.py`)."""
        try:
            return template.encode(messages, add_generation_prompt, self.tools.tools or None, self.template_kwargs,
                                   image_tokens=image_tokens, continue_final_message=self.continue_final_message)
        except RequestError:
            raise
        except Exception as e:  # the (sandboxed) template cannot render this request's messages or kwargs
            raise RequestError(f"the chat template failed on these messages ({type(e).__name__}: {e})",
                               field="messages") from e

    async def encode_with_images(self, template: ChatTemplate, messages: list[dict[str, Any]],
                                 add_generation_prompt: bool, config: ModelConfig,
                                 image_options: ImageOptions) -> tuple[list[int], list[PreparedImage]]:
        """`encode` for messages that may hold `image_url` parts: the images are loaded under the
        server's rules and each becomes its placeholder tokens -> (prompt ids, the images). The chat
        route and /tokenize both render a chat so."""
        marked, refs = extract_images(messages)
        images = await load_images(refs, config, image_options)
        placeholder = config.media_placeholder_token_id
        prompt = self.encode(template, marked, add_generation_prompt,
                             [[placeholder] * img.num_tokens for img in images])
        return prompt, images

    def parser(self, prompt: list[int], params: SamplingParams, tokenizer: Tokenizer) -> ChatChoiceParser | None:
        """The output parser for this request, or None (all content). Where the markers are special
        tokens, they must reach the text to be parsed, so `params` keeps special tokens then."""
        if not (self.thinking or self.tools.parse_calls):
            return None
        reasoning = ReasoningParser(starts_inside=opens_thinking(prompt, tokenizer)) if self.thinking else None
        if any(m in tokenizer.special_tokens for m in MARKERS):
            params.skip_special_tokens = False
        return ChatChoiceParser(reasoning, ToolCallParser(self.tools.parallel, self.history_call_ids)
                                if self.tools.parse_calls else None)



def opens_thinking(prompt: list[int], tokenizer: Tokenizer) -> bool:
    """The generation prompt ends inside an opened `<think>` section: the output starts with reasoning."""
    return tokenizer.decode(prompt[-16:], skip_special_tokens=False).rstrip().endswith(THINK_BEGIN)
