"""Grammar backends (``--grammar-backend xgrammar | none``): check and compile constraints.

    Constraint --check_grammar (submission, tokenizer-free, ~ms)--> 400 or accepted
               --backend.compile(c) (worker thread)--> Future[Grammar] --new_state()--> GrammarState

``XGrammarBackend`` is built once per engine from the model's Hugging Face tokenizer with the
MODEL's vocabulary size (``config.json`` ``vocab_size``, which may exceed the tokenizer's: ids
past the tokenizer are never allowed under a grammar). ``compile`` never blocks its caller: it
returns a future from a single worker thread; futures are kept in a bounded LRU keyed by
``Constraint.key``, so equal constraints (GRPO groups, n > 1, repeated prompts) compile once and
concurrent requests share one compile. A spec xgrammar rejects is a ``ValueError`` naming the
field and the problem, raised by ``check_grammar`` at submission (HTTP 400) or, for the rare
failure only the tokenizer-level compile finds, by the future's ``result()`` (that request
alone ends with the error).

``NoGrammarBackend`` is the disabled feature as a real object: every constraint is refused
with a message saying how to enable it.
"""

from __future__ import annotations

import abc
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Union

from rollout_engine.constrained.matcher import Grammar
from rollout_engine.constrained.spec import Constraint

__all__ = ["BACKENDS", "GrammarBackend", "NoGrammarBackend", "XGrammarBackend", "check_grammar",
           "create_grammar_backend", "refuse_structured_output"]

logger = logging.getLogger(__name__)

BACKENDS = ("xgrammar", "none")
NOT_ENABLED = "structured output is not enabled yet"
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean(e: BaseException) -> str:
    text = _CPP_PREFIX.sub("", str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


def refuse_structured_output(c: Constraint) -> None:
    """The submission check while no grammar reaches the sampler: always a ValueError."""
    raise ValueError(f"{c.name}: {NOT_ENABLED} (json_schema, regex, ebnf, structural_tag, "
                     "response_format and forced tool calls need the grammar-constrained "
                     "scheduler, which has not landed)")


# What xgrammar 0.2.8 lets into a string with minLength / maxLength: raw control characters (no
# strict JSON parser accepts them) and, for negated classes, surrogates and overlong UTF-8 (not
# UTF-8: each decodes to U+FFFD and breaks the length). Its pattern path with positive ranges
# split where the UTF-8 length changes is exact; quotes and backslashes stay out, as they did.
_PLAIN_CHAR = (r"( |!|[#-\[]|[\]-~]|[\u0080-\u07ff]|[\u0800-\ud7ff]|[\ue000-\uffff]"
               r"|[\u{10000}-\u{10FFFF}])")


def xgrammar_json_schema(spec: str) -> str:
    """``spec`` rewritten around xgrammar 0.2.8's gaps: a string schema's minLength /
    maxLength become the equivalent ``pattern``; pattern and a length bound together (which
    xgrammar would enforce only half of) is a ValueError."""
    schema, changed = _patch_schema(json.loads(spec))
    return json.dumps(schema, ensure_ascii=False) if changed else spec


def _patch_schema(node: Any) -> tuple[Any, bool]:
    if isinstance(node, list):
        items = [_patch_schema(v) for v in node]
        return [v for v, _ in items], any(c for _, c in items)
    if not isinstance(node, dict):
        return node, False
    parts = {k: _patch_schema(v) for k, v in node.items()}
    out = {k: v for k, (v, _) in parts.items()}
    changed = any(c for _, c in parts.values())
    bounds = [k for k in ("minLength", "maxLength") if k in out]
    if out.get("type") == "string" and bounds:
        if "pattern" in out or "format" in out:
            other = "pattern" if "pattern" in out else "format"
            raise ValueError(f"a string schema combines {other} with {' and '.join(bounds)}, "
                             "which xgrammar cannot enforce together")
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", None)
        if not isinstance(lo, int) or not (hi is None or isinstance(hi, int)):
            raise ValueError("minLength / maxLength: must be integers")
        out["pattern"] = f"^{_PLAIN_CHAR}{{{lo},{'' if hi is None else hi}}}$"
        changed = True
    return out, changed


def _patch_format(node: Any, max_ws: Optional[int] = None) -> Any:
    """The JSON schemas inside an xgrammar structural-tag format, patched (a missing one is
    the empty schema, as SGLang fills it); ``max_ws``: the server's JSON whitespace bound,
    where the format does not set its own."""
    if isinstance(node, list):
        return [_patch_format(v, max_ws) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _patch_format(v, max_ws) for k, v in node.items()}
    if out.get("type") in ("json_schema", "qwen_xml_parameter"):
        out["json_schema"] = _patch_schema(node.get("json_schema") or {})[0]
        if out.get("type") == "json_schema" and max_ws is not None:
            out.setdefault("max_whitespace_cnt", max_ws)
    return out


def _legacy_structural_tag(obj: dict[str, Any], max_ws: Optional[int] = None) -> Any:
    """SGLang's ``structures`` / ``triggers`` form as xgrammar's ``StructuralTag``."""
    import xgrammar as xgr

    tags = [xgr.StructuralTagItem(begin=s["begin"], end=s["end"], schema=json.dumps(
        _patch_schema(s.get("schema", s.get("parameters")) or {})[0])) for s in obj["structures"]]
    tag = xgr.StructuralTag.from_legacy_structural_tag(tags, obj["triggers"])
    tag.format.at_least_one = bool(obj.get("at_least_one", False))
    if max_ws is not None:
        for item in getattr(tag.format, "tags", []):
            if hasattr(item.content, "max_whitespace_cnt"):
                item.content.max_whitespace_cnt = max_ws
    return tag


def _structural_tag_arg(spec: str, max_ws: Optional[int] = None) -> Union[str, Any]:
    obj = json.loads(spec)
    if obj.get("structures") is not None:
        return _legacy_structural_tag(obj, max_ws)
    return json.dumps({"type": "structural_tag", "format": _patch_format(obj["format"], max_ws)})


def check_grammar(c: Constraint, *, any_whitespace: bool = True) -> None:
    """Raise ValueError (naming ``c.field``) unless xgrammar can build ``c``'s grammar.

    Tokenizer-free (``xgrammar.Grammar.from_*``: parse and convert, no vocabulary pass), so it
    is cheap enough for request submission; it finds bad regexes and EBNF, schema features
    xgrammar lacks and malformed structural tags before any compute.
    """
    import xgrammar as xgr

    try:
        if c.kind == "json_schema":
            xgr.Grammar.from_json_schema(xgrammar_json_schema(c.spec),
                                         any_whitespace=any_whitespace)
        elif c.kind == "regex":
            xgr.Grammar.from_regex(c.spec)
        elif c.kind == "ebnf":
            xgr.Grammar.from_ebnf(c.spec)
        elif c.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(_structural_tag_arg(c.spec))
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{c.name}: xgrammar cannot use this {c.kind}: {_clean(e)}") from None


class GrammarBackend(abc.ABC):
    """Checks and compiles constraints for one model's vocabulary.

    Owned by the scheduler (one per engine); ``compile`` may be called from the scheduler loop
    at any time (it only enqueues), ``shutdown`` once at the end.
    """

    name: str = ""

    @abc.abstractmethod
    def validate(self, c: Constraint) -> None:
        """Cheap submission-time check; ValueError naming the field and the problem."""

    @abc.abstractmethod
    def compile(self, c: Constraint) -> Future[Grammar]:
        """A future of ``c``'s compiled grammar (cached by ``c.key``). Its ``result()`` raises
        ValueError for a spec that cannot be compiled. Never blocks on the compile itself."""

    def stats(self) -> dict[str, Any]:
        """Counters for logs and benchmarks."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - a backend without a worker has nothing to stop
        """Stop the worker; pending futures are cancelled."""


class NoGrammarBackend(GrammarBackend):
    """``--grammar-backend none``: every constraint is refused (a 400 at submission)."""

    name = "none"

    def validate(self, c: Constraint) -> None:
        raise ValueError(f"{c.name}: structured output is disabled on this server "
                         "(--grammar-backend none); start it with --grammar-backend xgrammar")

    def compile(self, c: Constraint) -> Future[Grammar]:
        self.validate(c)
        raise AssertionError("unreachable")


class XGrammarBackend(GrammarBackend):
    """xgrammar over the model's tokenizer.

    ``vocab_size``: the model's (logits width), at least the tokenizer's. ``stop_token_ids``:
    the engine's EOS ids (what ends a grammar); None takes the tokenizer's. ``any_whitespace``
    / ``max_whitespace_cnt``: JSON whitespace between tokens (SGLang's default: any amount; a
    weak or random model under greedy decoding can emit it forever, which
    ``any_whitespace=False``, SGLang's ``--constrained-json-disable-any-whitespace``, or a
    count bound prevents). ``cache_size``: compiled grammars kept (LRU). ``compile_threads``:
    xgrammar's threads per compile.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 stop_token_ids: Optional[list[int]] = None, any_whitespace: bool = True,
                 max_whitespace_cnt: Optional[int] = None, cache_size: int = 256, compile_threads: int = 2,
                 max_rollback_tokens: int = 200) -> None:
        import xgrammar as xgr

        if cache_size < 1:
            raise ValueError(f"cache_size: must be >= 1, got {cache_size}")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        # our LRU holds the compiled grammars; xgrammar's own cache would be a second,
        # unbounded copy
        self._compiler = xgr.GrammarCompiler(info, max_threads=compile_threads,
                                             cache_enabled=False)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(info.stop_token_ids)
        self.any_whitespace = any_whitespace
        self.max_whitespace_cnt = max_whitespace_cnt
        self.cache_size = cache_size
        self.max_rollback_tokens = max_rollback_tokens
        self._cache: OrderedDict[tuple[str, str], Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._stats = {"compiles": 0, "cache_hits": 0, "compile_s": 0.0, "failures": 0}

    def validate(self, c: Constraint) -> None:
        check_grammar(c, any_whitespace=self.any_whitespace)

    def compile(self, c: Constraint) -> Future[Grammar]:
        with self._lock:
            fut = self._cache.get(c.key)
            if fut is not None:
                self._cache.move_to_end(c.key)
                self._stats["cache_hits"] += 1
                return fut
            fut = self._pool.submit(self._compile, c)
            self._cache[c.key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, c: Constraint) -> Grammar:
        start = time.perf_counter()
        try:
            compiled = self._compile_xgrammar(c)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            with self._lock:
                self._stats["failures"] += 1
            raise ValueError(f"{c.name}: xgrammar cannot compile this {c.kind}: "
                             f"{_clean(e)}") from None
        seconds = time.perf_counter() - start
        with self._lock:
            self._stats["compiles"] += 1
            self._stats["compile_s"] += seconds
        return Grammar(compiled, c, self.vocab_size, seconds, self.max_rollback_tokens)

    def _compile_xgrammar(self, c: Constraint) -> Any:
        comp = self._compiler
        if c.kind == "json_object":
            return comp.compile_builtin_json_grammar()
        if c.kind == "json_schema":
            return comp.compile_json_schema(xgrammar_json_schema(c.spec),
                                            any_whitespace=self.any_whitespace,
                                            max_whitespace_cnt=self.max_whitespace_cnt)
        if c.kind == "regex":
            return comp.compile_regex(c.spec)
        if c.kind == "ebnf":
            return comp.compile_grammar(c.spec)
        if c.kind == "structural_tag":
            # the server's JSON whitespace rule holds inside tags too (tool-call arguments); a
            # tag's JSON takes no "compact" switch, only a positive run bound: 1 at most
            max_ws = 1 if not self.any_whitespace else self.max_whitespace_cnt
            return comp.compile_structural_tag(_structural_tag_arg(c.spec, max_ws))
        raise ValueError(f"unknown constraint kind {c.kind!r}")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._stats, "cached": len(self._cache)}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def create_grammar_backend(name: str, tokenizer: Any, vocab_size: int,
                           **options: Any) -> GrammarBackend:
    """The backend ``--grammar-backend`` names (``xgrammar`` or ``none``)."""
    if name == "xgrammar":
        return XGrammarBackend(tokenizer, vocab_size, **options)
    if name == "none":
        return NoGrammarBackend()
    raise ValueError(f"grammar_backend: must be one of {', '.join(BACKENDS)}, got {name!r}")
