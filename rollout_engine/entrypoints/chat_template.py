"""Chat messages -> prompt text, as transformers' ``apply_chat_template(..., tokenize=False)``
renders them, in a ``BoundedSandbox``: a render that runs past ``max_template_render_s`` or
builds values past the sandbox's caps is a ``TemplateLimitError``, and any other error the
template raises a ``ValueError`` (both HTTP 400).

The template is the tokenizer's own unless the caller passes one; whether a request may pass one
(``--trust-request-chat-template``) is the route's decision, not this module's.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from rollout_engine.entrypoints.template_sandbox import BoundedSandbox, TemplateLimitError

__all__ = ["MAX_REQUEST_TEMPLATE_CHARS", "ChatTemplateRenderer", "TemplateLimitError"]

# Compiling is not interruptible (about 20 us a character on a slow CPU): a template that comes
# with a request is kept short enough to compile well within any sensible render bound.
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024
# Names the renderer passes itself; a template kwarg may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt",
                            "continue_final_message")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateRenderer:
    """Renders chat messages with ``tokenizer``'s template (or one the caller passes) within
    ``limit_s`` seconds; ``limit_name`` is how errors name that limit. Thread-safe; compiled
    templates are cached (the most recent few)."""

    def __init__(self, tokenizer: Any, limit_s: float,
                 limit_name: str = "--max-template-render-s") -> None:
        self.tokenizer = tokenizer
        self.limit_s = limit_s
        self.limit_name = limit_name
        self.env = BoundedSandbox()
        self._compile = functools.lru_cache(maxsize=16)(self.env.from_string)

    def render(self, messages: list[dict[str, Any]], *,
               tools: Optional[list[dict[str, Any]]] = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_kwargs: Optional[dict[str, Any]] = None,
               template: Optional[str] = None,
               documents: Optional[list[dict[str, Any]]] = None) -> str:
        """The prompt text. ``template``: a template to use instead of the tokenizer's
        (at most MAX_REQUEST_TEMPLATE_CHARS); ``documents``: the template's ``documents``
        (retrieval documents, as transformers passes them). ValueError names what was
        wrong."""
        if template is not None and len(template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise ValueError(f"chat_template: {len(template)} characters; a template sent with "
                             f"a request has at most {MAX_REQUEST_TEMPLATE_CHARS} "
                             "(MAX_REQUEST_TEMPLATE_CHARS)")
        source = self.tokenizer.get_chat_template(template, tools or None)
        kwargs = dict(template_kwargs or {})
        for name in RESERVED_TEMPLATE_KWARGS:
            if name in kwargs:
                raise ValueError(f"chat_template_kwargs.{name}: is set by the request itself, "
                                 "not a template argument")
        chat = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None})
                for m in messages]
        final = _tag_final_message(chat, source) if continue_final_message else None
        context = {**self.tokenizer.special_tokens_map, **kwargs}
        with self.env.bounded(self.limit_s, f"max_template_render_s, {self.limit_name}"):
            try:
                text = self._compile(source).render(
                    messages=chat, tools=tools or None, documents=documents,
                    add_generation_prompt=add_generation_prompt, **context)
            except TemplateLimitError:
                raise
            except Exception as e:  # noqa: BLE001 - what a template raises is its input's fault
                raise ValueError(f"messages: the chat template could not render them: "
                                 f"{type(e).__name__}: {e}") from None
        return text if final is None else _cut_at_tag(text, final)


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by, as transformers passes it:
    ``reasoning_content`` (the standard one) and ``thinking`` (gpt-oss)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """Mark the end of the last message's content so the text after it can be cut off;
    returns the content."""
    final = chat[-1].get("content")
    if not isinstance(final, str):
        raise ValueError("continue_final_message: the final message has no text content")
    if "content" not in source:
        raise ValueError("continue_final_message: the chat template does not render content")
    chat[-1]["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template does not render the final "
                         "message as it is, so it cannot be continued")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
