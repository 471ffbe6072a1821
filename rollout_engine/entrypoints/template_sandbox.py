"""A Jinja sandbox whose renders are bounded in time and in size.

A chat template is a program, and a short one can run for hours (nested ``range`` loops) or build
gigabytes (``'x' * 10 ** 10``). ``BoundedSandbox`` is jinja2's immutable sandbox, set up as
transformers sets it up for ``apply_chat_template`` (so a template renders the same text), with
every place a template can repeat work or grow data checked against the active
``RenderBudget``:

    each loop iteration, call (macros, methods, ``loop()``), filter,
    ``{% set %}`` and piece of output           -> the deadline has not passed
    ``+ * ** %`` and ``~``, joins, replaces, padding
    and format widths                           -> the result's size, before it is built
    values stored, passed to or returned by
    calls and filters; all output together      -> MAX_TEMPLATE_VALUE / MAX_TEMPLATE_OUTPUT

Loops and output are reached by rewriting the parsed template before it is compiled: each
``for`` iterates through a counting iterator, each piece of output passes a hook. A limit
exceeded raises ``TemplateLimitError`` (a ``ValueError``: HTTP 400). Not bounded in advance: a
single operation whose size cannot be told before it runs (``str()`` of a large nested value) is
checked after it ran, so it may briefly hold a few times the cap.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Optional

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

__all__ = ["MAX_TEMPLATE_OUTPUT", "MAX_TEMPLATE_VALUE", "BoundedSandbox", "RenderBudget",
           "TemplateLimitError"]

MAX_TEMPLATE_VALUE = 1 << 24    # characters of a string or items of a container a template makes
MAX_TEMPLATE_OUTPUT = 4 * MAX_TEMPLATE_VALUE   # output of one render, macro and set buffers too
MAX_POW_BITS = 1 << 16          # the largest integer ``**`` may build
_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class TemplateLimitError(ValueError):
    """A render passed its deadline or would have built a value over a size cap."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def _check_size(n: int, what: str) -> None:
    if n > MAX_TEMPLATE_VALUE:
        raise TemplateLimitError(f"chat template: {what} would have {n} characters or items; "
                                 f"at most {MAX_TEMPLATE_VALUE} (MAX_TEMPLATE_VALUE)")


def _check_ints(values: Iterable[Any], what: str) -> None:
    """Widths and counts: an integer argument larger than any value a template may build."""
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_TEMPLATE_VALUE:
            raise TemplateLimitError(f"chat template: {what} got {v}; widths and counts are at "
                                     f"most {MAX_TEMPLATE_VALUE} (MAX_TEMPLATE_VALUE)")


def _check_percent(fmt: str, values: Any) -> None:
    """``fmt % values``: the widths in ``fmt``, and the values when a width is ``*``."""
    star = False
    for m in _PERCENT_SPEC.finditer(fmt):
        for width in m.groups():
            star = star or width == "*"
            if width and width != "*":
                _check_ints([int(width)], "a % format width")
    if star:
        _check_ints(values if isinstance(values, tuple) else (values,), "a % format width")


def _check_format_spec(fmt: str) -> None:
    """``fmt.format(...)``: the widths and precisions written in its replacement fields."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return   # malformed: the call itself raises
    for _, _, spec, _ in fields:
        _check_ints((int(d) for d in re.findall(r"\d+", spec or "")), "a format width")


def _check_replace(s: Any, old: Any, new: Any, what: str) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        hits = len(s) + 1 if old == "" else s.count(old)
        _check_size(len(s) + hits * (len(new) - len(old)), what)


def _check_join(sep: Any, items: list[Any], what: str) -> None:
    if isinstance(sep, str):
        n = len(sep) * max(len(items) - 1, 0) + sum(_size(i) for i in items if isinstance(i, str))
        _check_size(n, what)


class RenderBudget:
    """What one render may spend: ``limit_s`` seconds from its start and MAX_TEMPLATE_OUTPUT
    characters of output. ``limit_name`` says where the time limit is set (an error names it)."""

    def __init__(self, limit_s: float, limit_name: str) -> None:
        self.limit_s = limit_s
        self.limit_name = limit_name
        self.deadline = time.monotonic() + limit_s
        self.output = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"chat template: rendering took longer than {self.limit_s:g} s "
                f"({self.limit_name}); the template or its inputs are too costly")

    def emit(self, text: str) -> str:
        self.tick()
        self.output += len(text)
        if self.output > MAX_TEMPLATE_OUTPUT:
            raise TemplateLimitError(f"chat template: the output passed {MAX_TEMPLATE_OUTPUT} "
                                     "characters (MAX_TEMPLATE_OUTPUT)")
        return text


class _Hook:
    """A callable the rewritten template calls through ``environment.<name>``; ``call`` runs it
    without the checks a template's own calls get."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _hooked(name: str, arg: nodes.Node, lineno: int) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name, lineno=lineno), [arg], [], None, None,
                      lineno=lineno)


class _Instrument(NodeTransformer):
    """Route loops, output, ``{% set %}`` values and ``~`` through the sandbox's hooks."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _hooked("bounded_iter", node.iter, node.lineno)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [_hooked("bounded_emit", nodes.Const(c.data, lineno=c.lineno)
                              if isinstance(c, nodes.TemplateData) else c, c.lineno)
                      for c in node.nodes]
        return node

    def visit_Assign(self, node: nodes.Assign) -> nodes.Node:
        self.generic_visit(node)
        node.node = _hooked("bounded_store", node.node, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _hooked("bounded_concat", nodes.List(node.nodes, lineno=node.lineno), node.lineno)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for transformers' training
    masks; rendering a prompt keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


class _TemplateNamespace(Namespace):
    """``namespace()`` that refuses underscore names (no route to an object's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:   # noqa: N805 - Namespace's own signature
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not store underscore names on a namespace: {name!r}")


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The chat-template environment (transformers' globals and filters: ``raise_exception``,
    ``strftime_now``, ``tojson``, ``namespace``, ``dict``, ``{% generation %}``, loop
    controls) with bounded renders. Compile and render inside ``bounded()``."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, loopcontrols])
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        self._budget: contextvars.ContextVar[Optional[RenderBudget]] = contextvars.ContextVar(
            "template_budget", default=None)
        self.bounded_iter = _Hook(self._iterate)
        self.bounded_emit = _Hook(lambda v: self.budget().emit(str(v)))
        self.bounded_store = _Hook(self._store)
        self.bounded_concat = _Hook(self._concat)

    # -- the budget ----------------------------------------------------------------------------
    @contextmanager
    def bounded(self, limit_s: float, limit_name: str) -> Iterator[RenderBudget]:
        """Install a ``RenderBudget`` for what this thread compiles and renders meanwhile."""
        if self._budget.get() is not None:
            raise RuntimeError("BoundedSandbox.bounded: a budget is already active here")
        budget = RenderBudget(limit_s, limit_name)
        token = self._budget.set(budget)
        try:
            yield budget
        finally:
            self._budget.reset(token)

    def budget(self) -> RenderBudget:
        budget = self._budget.get()
        if budget is None:
            raise RuntimeError("a chat template ran outside BoundedSandbox.bounded()")
        return budget

    # -- compiling: the rewrite ----------------------------------------------------------------
    def compile(self, source: Any, name: Optional[str] = None, filename: Optional[str] = None,
                raw: bool = False, defer_init: bool = False) -> Any:
        if isinstance(source, str):
            tree = _Instrument().visit(self.parse(source, name, filename))
            tree.set_environment(self)
            source = tree
        if raw:
            return super().compile(source, name, filename, True, defer_init)
        return super().compile(source, name, filename, False, defer_init)

    # -- the hooks -----------------------------------------------------------------------------
    def _iterate(self, iterable: Any) -> Iterator[Any]:
        budget = self.budget()
        for item in iterable:
            budget.tick()
            yield item

    def _store(self, value: Any) -> Any:
        self.budget().tick()
        _check_size(_size(value), "a {% set %} value")
        return value

    def _concat(self, parts: list[Any]) -> str:
        self.budget().tick()
        texts = [str(p) for p in parts]
        _check_size(sum(map(len, texts)), "a ~ concatenation")
        return "".join(texts)

    # -- a template's own operations -----------------------------------------------------------
    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if isinstance(__obj, _Hook):
            return __obj(*args)
        __self.budget().tick()
        for value in (*args, *kwargs.values()):
            _check_size(_size(value), "a call argument")
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str):
            args = _checked_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(_size(result), "a call's result")
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and isinstance(left, _SIZED) and isinstance(right, _SIZED):
            _check_size(len(left) + len(right), "a + result")
        elif operator == "*":
            seq, n = (left, right) if isinstance(left, _SIZED) else (right, left)
            if isinstance(seq, _SIZED) and isinstance(n, int):
                _check_size(len(seq) * max(n, 0), "a * repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left).bit_length() - 1, 0) * right > MAX_POW_BITS:
                raise TemplateLimitError(f"chat template: {left} ** {right} is larger than "
                                         f"2 ** {MAX_POW_BITS} (MAX_POW_BITS)")
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        result = super().call_binop(context, operator, left, right)
        _check_size(_size(result), f"a {operator} result")
        return result

    def _bounded_filter(self, name: str, f: Any) -> Any:
        first = 2 if hasattr(f, "jinja_pass_arg") else 1   # after the environment / context

        @functools.wraps(f)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self.budget().tick()
            value, extra = args[first - 1], args[first:]
            what = f"filter {name!r}"
            if name == "format":
                if isinstance(value, str):
                    _check_percent(value, tuple(extra) or kwargs)
            else:
                _check_ints((*extra, *kwargs.values()), what)
            if name == "replace" and len(extra) >= 2:
                _check_replace(value, extra[0], extra[1], f"the result of {what}")
            if name == "join" and isinstance(value, _SIZED):
                _check_join(extra[0] if extra else kwargs.get("d", ""), list(value),
                            f"the result of {what}")
            if name == "indent" and isinstance(value, str):
                width = extra[0] if extra else kwargs.get("width", 4)
                pad = len(width) if isinstance(width, str) else width
                if isinstance(pad, int):
                    _check_size(len(value) + (value.count("\n") + 1) * pad,
                                f"the result of {what}")
            result = f(*args, **kwargs)
            _check_size(_size(result), f"the result of {what}")
            return result

        return bounded


def _checked_str_method(owner: str, name: str, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Check a call of ``owner.<name>`` before it runs (padding widths, format widths, the
    size of a replace or join); returns the arguments to call it with."""
    what = f"str.{name}"
    _check_ints((*args, *kwargs.values()), what)
    if name in ("format", "format_map"):
        _check_format_spec(owner)
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1], f"the result of {what}")
    elif name == "join" and args:
        items = list(args[0])
        _check_join(owner, items, f"the result of {what}")
        return (items, *args[1:])
    return args
