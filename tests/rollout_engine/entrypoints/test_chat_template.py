"""``ChatTemplateRenderer`` renders what transformers' ``apply_chat_template(tokenize=False)``
renders (the reference), within its time bound."""

from __future__ import annotations

import time
from typing import Any, Optional

import pytest

from rollout_engine.entrypoints.chat_template import (
    MAX_REQUEST_TEMPLATE_CHARS,
    ChatTemplateRenderer,
    TemplateLimitError,
)

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "ok", "reasoning": "thought"},
    {"role": "user", "content": "more"},
]
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "find it",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer",
                                                          "maximum": 4294967295}}}}}]
TEMPLATES = {
    "model's own": None,
    "namespace+tojson": (
        "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- set ns.n = ns.n + 1 %}"
        "{{ loop.index }}:{{ m.role }}={{ m.content ~ '|' ~ (m.reasoning_content or '') }}"
        "{% if loop.last %}!{% endif %}\n{%- endfor %}{{ ns.n }}"
        "{% if tools %}{{ tools|tojson(indent=2) }}{% endif %}{{ bos_token }}{{ eos_token }}"
        "{{ flavour }}{% if add_generation_prompt %}<gen>{% endif %}"),
    "macros+filters": (
        "{% macro r(v) %}{% if v is mapping %}{% for k, x in v|dictsort %}{{ k }}({{ r(x) }})"
        "{% endfor %}{% else %}{{ v }}{% endif %}{% endmacro %}"
        "{% for t in tools or [] %}{{ r(t) }}{% endfor %}{% for m in messages %}{% generation %}"
        "{{ m.content|upper|replace('I', '1') }}{% endgeneration %}"
        "{{ '%s-%d'|format(m.role, loop.index) }}{{ '{:>5}'.format(m.role) }}"
        "{{ m.content.center(12) }}{{ m.thinking or '' }}{% endfor %}{{ dict(a=1)|tojson }}"
        "{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_paths: dict[str, str]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_paths["qwen2"])


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("continue_final", [False, True], ids=["generation-prompt", "continue"])
def test_renders_what_transformers_renders(tokenizer: Any, name: str, tools: Optional[list],
                                           continue_final: bool) -> None:
    template = TEMPLATES[name]
    reference = tokenizer.apply_chat_template(
        MESSAGES, tools=tools, chat_template=template, tokenize=False,
        add_generation_prompt=not continue_final, continue_final_message=continue_final,
        flavour="salty")
    got = ChatTemplateRenderer(tokenizer, 5.0).render(
        MESSAGES, tools=tools, template=template, add_generation_prompt=not continue_final,
        continue_final_message=continue_final, template_kwargs={"flavour": "salty"})
    assert got == reference


def test_a_runaway_template_is_refused_at_the_bound(tokenizer: Any) -> None:
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    renderer = ChatTemplateRenderer(tokenizer, 0.3)
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=r"0.3 s \(max_template_render_s, "
                                                 r"--max-template-render-s\)"):
        renderer.render(MESSAGES, template=slow)
    assert time.monotonic() - start < 2.3
    # the renderer still works afterwards
    assert renderer.render(MESSAGES) == tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_template_errors_and_misuse_are_value_errors(tokenizer: Any) -> None:
    renderer = ChatTemplateRenderer(tokenizer, 5.0)
    with pytest.raises(ValueError, match="^messages: the chat template could not render them: "
                                         "TemplateError: nope"):
        renderer.render(MESSAGES, template="{{ raise_exception('nope') }}")
    with pytest.raises(ValueError, match="^chat_template_kwargs.messages: "):
        renderer.render(MESSAGES, template_kwargs={"messages": []})
    with pytest.raises(ValueError, match=f"at most {MAX_REQUEST_TEMPLATE_CHARS}"):
        renderer.render(MESSAGES, template="x" * (MAX_REQUEST_TEMPLATE_CHARS + 1))
    assert renderer.render(MESSAGES, template="x" * MAX_REQUEST_TEMPLATE_CHARS) == \
        "x" * MAX_REQUEST_TEMPLATE_CHARS
