"""The bounded Jinja sandbox: runaway loops and recursion stop at the render's deadline; values
that would pass the size cap are refused before they are built; ordinary templates render as
jinja2's sandbox renders them."""

from __future__ import annotations

import time

import pytest

from rollout_engine.entrypoints.template_sandbox import (
    MAX_TEMPLATE_VALUE,
    BoundedSandbox,
    TemplateLimitError,
)

LIMIT_S = 0.3


def render(source: str, limit_s: float = LIMIT_S, **context: object) -> str:
    env = BoundedSandbox()
    with env.bounded(limit_s, "--test-limit"):
        return env.from_string(source).render(**context)


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
    "{{ f(60) }}",
    "{% set xs = range(100000)|list %}{% for a in xs %}{{ xs|join(',')|length }}{% endfor %}",
    "{% for n in [60] recursive %}{% if n > 0 %}{{ loop([n - 1, n - 1]) }}{% endif %}"
    "{% endfor %}",
], ids=["nested-range", "nested-range-output", "macro-fanout", "filter-in-loop", "recursive-loop"])
def test_a_runaway_template_stops_at_the_deadline(source: str) -> None:
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=r"longer than 0.3 s \(--test-limit\)"):
        render(source)
    elapsed = time.monotonic() - start
    assert LIMIT_S <= elapsed < LIMIT_S + 2.0, elapsed


@pytest.mark.parametrize("source", [
    "{{ 'x' * 10000000000 }}",
    "{{ ['x'] * 10000000000 }}",
    "{{ 'x'|center(10000000000) }}",
    "{{ 'x'.ljust(10000000000) }}",
    "{{ '%099999999999d' % 1 }}",
    "{{ '%*d' % (10000000000, 1) }}",
    "{{ '%099999999999d'|format(1) }}",
    "{{ '{:>99999999999}'.format(1) }}",
    "{{ [1]|batch(10000000000, 0)|list }}",
    "{{ ('x' * 100000)|replace('', 'y' * 100000) }}",
    "{{ ('x' * 100000).replace('', 'y' * 100000) }}",
    "{{ ('xy' * 100000).join(['ab' * 100000] * 1000) }}",
    "{{ (['ab' * 100000] * 1000)|join('xy' * 100000) }}",
    "{{ ('x\n' * 1000000)|indent(100) }}",
    "{% set x = 'ab' %}" + "{% set x = x ~ x %}" * 40,
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}",
], ids=lambda s: s[:40])
def test_a_value_over_the_size_cap_is_refused_before_it_is_built(source: str) -> None:
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=str(MAX_TEMPLATE_VALUE)):
        render(source, limit_s=60.0)
    assert time.monotonic() - start < 5.0


def test_a_power_over_the_cap_is_refused_before_it_is_computed() -> None:
    with pytest.raises(TemplateLimitError, match="MAX_POW_BITS"):
        render("{{ 10 ** 1000000 }}", limit_s=60.0)
    assert render("{{ 2 ** 64 }}") == str(2 ** 64)


def test_output_over_the_cap_is_refused() -> None:
    big = "{% set s = 'x' * 16000000 %}" + "{{ s }}" * 5
    with pytest.raises(TemplateLimitError, match="MAX_TEMPLATE_OUTPUT"):
        render(big, limit_s=60.0)


@pytest.mark.parametrize("source, expected", [
    ("{% for m in messages %}{{ loop.index }}{{ m.role ~ ':' ~ m.content }}"
     "{% if not loop.last %}|{% endif %}{% endfor %}", "1a:x|2b:y"),
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
     "{{ ns.n }}{{ messages|map(attribute='role')|join(',') }}", "2a,b"),
    ("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}"
     "{% break %}{% endif %}{{ i }}{% endfor %}", "02"),
    ("{{ '%s=%03d'|format('k', 7) }} {{ '{}-{:>3}'.format('a', 'b') }} {{ 'ab' * 2 }}"
     " {{ 2 ** 10 }} {{ 'x'.center(5) }}|", "k=007 a-  b abab 1024   x  |"),
    ("{{ {'a': [1, 'é']}|tojson }} {{ dict(a=1)|tojson(indent=1) }}",
     '{"a": [1, "é"]} {\n "a": 1\n}'),
    ("{% generation %}{{ messages[0].content }}{% endgeneration %}", "x"),
    ("{% macro m(v) %}<{{ v }}>{% endmacro %}{% for m2 in messages %}{{ m(m2.role) }}"
     "{% endfor %}{% filter upper %}z{% endfilter %}", "<a><b>Z"),
])
def test_ordinary_templates_render_as_usual(source: str, expected: str) -> None:
    messages = [{"role": "a", "content": "x"}, {"role": "b", "content": "y"}]
    assert render(source, messages=messages) == expected


def test_namespace_refuses_underscore_names() -> None:
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError, match="underscore"):
        render("{% set ns = namespace() %}{% set ns._x = 1 %}")


def test_a_render_outside_a_budget_is_an_error() -> None:
    env = BoundedSandbox()
    template = env.from_string("{{ 1 }}")
    with pytest.raises(RuntimeError, match="bounded"):
        template.render()
    with env.bounded(1.0, "x"):
        assert template.render() == "1"
        with pytest.raises(RuntimeError, match="already"), env.bounded(1.0, "x"):
            pass
