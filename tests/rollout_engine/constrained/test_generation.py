"""End to end without the scheduler: a decoding loop over random logits and over a
random-weight tiny model (which would otherwise emit garbage), with the grammar mask applied;
every output must parse and validate, greedy and sampled, n = 8 per grammar.

The loop is what the scheduler integration does per step: prepare the mask for the rows with a
grammar, apply it to the logits, pick a token, advance, end a row when its grammar terminates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Optional

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_engine.constrained import GrammarBatch, XGrammarBackend, make_constraint
from tests.rollout_engine.constrained.conftest import PADDED_VOCAB

# transformers 5 renames the KV-cache argument; the tiny loop below uses the old name
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
N = 8
MAX_STEPS = 1500

Logits = Callable[[int, list[int]], torch.Tensor]   # (step, last tokens) -> [N, V]


def decode(backend: XGrammarBackend, tokenizer: Any, kind: str, spec: Any, logits_fn: Logits,
           greedy: bool, seed: int = 0, temperature: float = 1.0) -> list[str]:
    """N rows under one grammar, plus one unconstrained row that must be left untouched."""
    grammar = backend.compile(make_constraint(kind, spec)).result()
    states: list[Optional[Any]] = [grammar.new_state() for _ in range(N)]
    batch = GrammarBatch(backend.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    outs: list[list[int]] = [[] for _ in range(N)]
    last = [tokenizer.bos_token_id or 0] * N
    for step in range(MAX_STEPS):
        if all(s is None for s in states):
            break
        logits = logits_fn(step, last).float()
        free = torch.randn(1, logits.shape[1], generator=gen)
        both = torch.cat([logits, free])
        mask = batch.prepare([*states, None])
        assert mask is not None
        mask.apply(both)
        assert torch.equal(both[N], free[0])
        for i, state in enumerate(states):
            if state is None:
                continue
            row = both[i]
            tok = int(row.argmax()) if greedy else int(torch.multinomial(
                torch.softmax(row / temperature, -1), 1, generator=gen))
            assert tok < len(tokenizer), "a padding id past the tokenizer was sampled"
            last[i] = tok
            if batch.advance(state, tok):
                states[i] = None          # the grammar ended the request
            else:
                outs[i].append(tok)
    assert all(s is None for s in states), f"a grammar did not end within {MAX_STEPS} steps"
    return [tokenizer.decode(o) for o in outs]


def random_logits(seed: int) -> Logits:
    gen = torch.Generator().manual_seed(seed)
    return lambda step, last: torch.randn(N, PADDED_VOCAB, generator=gen) * 4


class TinyModel:
    """The random-weight tiny Qwen2 through transformers, with its KV cache (n rows)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.vocab_size = self.model.config.vocab_size

    def logits_fn(self, prompt: list[int]) -> Logits:
        state: dict[str, Any] = {}

        @torch.no_grad()
        def step(i: int, last: list[int]) -> torch.Tensor:
            ids = torch.tensor([prompt] * N) if i == 0 else torch.tensor(last)[:, None]
            out = self.model(input_ids=ids, past_key_values=state.get("kv"), use_cache=True)
            state["kv"] = out.past_key_values
            return out.logits[:, -1]

        return step


# -- schemas: object / array / enum / number / string, bounded depth -----------------------------
_leaf = st.one_of(
    st.just({"type": "integer"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n},
              st.integers(1, 3), st.integers(0, 3)),
    st.builds(lambda vals: {"enum": vals}, st.one_of(
        st.lists(st.text("abc xyz", max_size=4), min_size=1, max_size=3, unique=True),
        st.lists(st.integers(-9, 99), min_size=1, max_size=3, unique=True))),
)


def _object(props: dict[str, Any], data: Any) -> dict[str, Any]:
    names = list(props)
    return {"type": "object", "properties": props,
            "required": [k for k, keep in zip(names, data) if keep]}


_schemas = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
              inner, st.integers(0, 3)),
    st.builds(_object, st.dictionaries(st.sampled_from(["a", "bb", "c_d", "name"]), inner,
                                       min_size=1, max_size=3),
              st.lists(st.booleans(), min_size=3, max_size=3)),
), max_leaves=5)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_schemas, greedy=st.booleans(), seed=st.integers(0, 2**16))
def test_random_schemas_always_validate(backend: XGrammarBackend, tokenizer: Any,
                                        schema: dict[str, Any], greedy: bool, seed: int) -> None:
    for text in decode(backend, tokenizer, "json_schema", json.dumps(schema),
                       random_logits(seed), greedy, seed):
        jsonschema.validate(json.loads(text), schema)


REGEXES = [r"(yes|no)", r"[a-c]{1,4}-\d{2}", r"(0|[1-9]\d{0,3})(\.\d{1,2})?",
           r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}", r"\((x|y),(x|y)\)"]


@pytest.mark.parametrize("regex", REGEXES)
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_regexes_fullmatch(backend: XGrammarBackend, tokenizer: Any, regex: str,
                           greedy: bool) -> None:
    for text in decode(backend, tokenizer, "regex", regex, random_logits(7), greedy, 7):
        assert re.fullmatch(regex, text), (regex, text)


# sums and products of small numbers, parenthesized two deep at most (bounded, so every row
# ends: a model that never picks the end would otherwise run to max_new_tokens)
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor ("*" factor){0,2}
factor ::= num | "(" inner ")"
inner ::= atom (("+" | "-" | "*") atom){0,3}
atom ::= num | "(" num ("+" | "-") num ")"
num ::= [0-9] | [1-9] [0-9]
"""
_EXPR = re.compile(r"[0-9+\-*()]+")


def _is_expression(text: str) -> bool:
    if not _EXPR.fullmatch(text) or re.search(r"\b0\d", text):
        return False
    try:
        eval(compile(text, "<expr>", "eval"), {"__builtins__": {}})  # noqa: S307 - digits/ops only
    except SyntaxError:
        return False
    return True


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_ebnf_expressions_parse(backend: XGrammarBackend, tokenizer: Any, greedy: bool) -> None:
    for text in decode(backend, tokenizer, "ebnf", EBNF, random_logits(3), greedy, 3):
        assert _is_expression(text), text


# -- the random-weight model ------------------------------------------------------------------
MODEL_SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no", "maybe"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "reasons": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    "ratio": {"type": "number"}}, "required": ["answer", "score", "reasons"]}


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: str) -> TinyModel:
    return TinyModel(tiny_dir)


@pytest.fixture(scope="module")
def model_backend(tokenizer: Any, tiny_model: TinyModel) -> Any:
    # compact JSON: under greedy decoding the random model, given any whitespace, emits it
    # forever (valid, never finished); the random-logits tests above keep any whitespace
    be = XGrammarBackend(tokenizer, tiny_model.vocab_size, any_whitespace=False)
    yield be
    be.shutdown()


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind, spec, check", [
    ("json_schema", MODEL_SCHEMA,
     lambda t: jsonschema.validate(json.loads(t), MODEL_SCHEMA) is None),
    ("regex", REGEXES[1], lambda t: re.fullmatch(REGEXES[1], t) is not None),
    ("ebnf", EBNF, _is_expression),
], ids=["json_schema", "regex", "ebnf"])
def test_tiny_model_outputs_parse(model_backend: XGrammarBackend, tokenizer: Any,
                                  tiny_model: TinyModel, kind: str, spec: Any,
                                  check: Callable[[str], bool], greedy: bool) -> None:
    prompt = tokenizer.encode("Answer in JSON: is the sky green?", add_special_tokens=False)
    texts = decode(model_backend, tokenizer, kind, spec, tiny_model.logits_fn(prompt), greedy,
                   temperature=1.0)
    assert all(check(t) for t in texts), texts
    if not greedy:
        assert len(set(texts)) > 1          # sampled rows differ; greedy rows are all equal


def test_unconstrained_tiny_model_emits_garbage(tokenizer: Any, tiny_model: TinyModel) -> None:
    """What the grammar saves: the same model, unmasked, produces no JSON."""
    prompt = tokenizer.encode("Answer in JSON: is the sky green?", add_special_tokens=False)
    step = tiny_model.logits_fn(prompt)
    last = [0] * N
    outs: list[list[int]] = [[] for _ in range(N)]
    for i in range(40):
        last = step(i, last).argmax(-1).tolist()
        for o, t in zip(outs, last):
            o.append(t)
    for o in outs:
        with pytest.raises(ValueError):
            json.loads(tokenizer.decode(o))
