"""Validation and expansion of generate calls: text or ids, batch, ``n`` -> GenerateReq list.

Everything a caller can get wrong is caught here, before anything reaches the scheduler, and
raised as ``ValueError`` naming the field.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from rollout_engine.constrained.backend import NoGrammarBackend, check_grammar
from rollout_engine.constrained.spec import Constraint
from rollout_engine.protocol.messages import Bootstrap, GenerateReq
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.sampling_seeds import derive_seed
from rollout_engine.selected_ids import check_scoring, per_prompt_ids, per_prompt_positions

MAX_REQUESTS_PER_CALL = 4096   # prompts x n of one generate call; more is a 400, not an OOM


def grammar_check_for(config: Any) -> Callable[[Constraint], None]:
    """The submission check ``--grammar-backend`` implies (``EngineConfig``): xgrammar's
    tokenizer-free check, or the disabled backend's refusal."""
    if config.grammar_backend == "none":
        return NoGrammarBackend().validate
    any_ws = not config.constrained_json_disable_any_whitespace
    return lambda c: check_grammar(c, any_whitespace=any_ws)


@dataclass(frozen=True)
class RequestLimits:
    """Caps on what one request may cost the scheduler (``EngineConfig``'s flags of the same
    names): top logprobs per token (memory and sampling time per step), and the number and
    length of stop strings and stop token ids (checked at every step). A refusal is a
    ValueError naming the field, the cap and the flag that raises it."""

    max_top_logprobs_num: int
    max_stop_strings: int
    max_stop_str_len: int
    max_stop_token_ids: int

    @classmethod
    def of(cls, config: Any) -> RequestLimits:
        return cls(config.max_top_logprobs_num, config.max_stop_strings,
                   config.max_stop_str_len, config.max_stop_token_ids)

    def check_top_logprobs(self, num: int, field: str = "top_logprobs_num") -> None:
        if num > self.max_top_logprobs_num:
            raise ValueError(f"{field}: {num} top logprobs per token; this server allows at "
                             f"most {self.max_top_logprobs_num} (max_top_logprobs_num; "
                             "--max-top-logprobs-num raises it)")

    def check_stops(self, stop: Any, stop_token_ids: Any, prefix: str = "sampling_params."
                    ) -> None:
        """``stop``: a string or a list of them; ``stop_token_ids``: a list (None: none)."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.max_stop_strings:
            raise ValueError(f"{prefix}stop: {len(stops)} stop strings; this server allows at "
                             f"most {self.max_stop_strings} (max_stop_strings; "
                             "--max-stop-strings raises it)")
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        if longest > self.max_stop_str_len:
            raise ValueError(f"{prefix}stop: a stop string of {longest} characters; this server "
                             f"allows at most {self.max_stop_str_len} (max_stop_str_len; "
                             "--max-stop-str-len raises it)")
        num_ids = len(stop_token_ids or [])
        if num_ids > self.max_stop_token_ids:
            raise ValueError(f"{prefix}stop_token_ids: {num_ids} ids; this server allows at "
                             f"most {self.max_stop_token_ids} (max_stop_token_ids; "
                             "--max-stop-token-ids raises it)")


NOT_RECORDED = ("this server does not record routed experts; start it with "
                "--enable-return-routed-experts (Engine(enable_return_routed_experts=True))")


def routed_experts_refusal(enabled: bool, bytes_per_token: int) -> Optional[str]:
    """Why requests may not ask for routed experts on an engine started with the flag
    ``enabled`` whose scheduler records ``bytes_per_token`` of routing per token (0: the model
    has no experts), or None."""
    if not enabled:
        return NOT_RECORDED
    if bytes_per_token <= 0:
        return ("the model has no experts (it is not a mixture-of-experts model): there is no "
                "routing to return")
    return None


class RequestBuilder:
    """Validates and expands generate calls.

    ``pool_tokens`` is the KV pool's size in tokens (whole pages; None: not checked). A request
    whose prompt + max_new_tokens exceeds it is refused: it could outgrow the pool even alone,
    and the scheduler would have to abort it midway (or, with a prompt that never fits, could
    never admit it). Within the pool, the request always fits once it runs alone.

    ``limits`` caps each request's top logprobs and stop conditions (``RequestLimits``).

    ``routed_experts_refusal``: why no request may ask for its routed experts here (the
    engine does not record them: ``routed_experts_refusal``), or None when they are recorded.

    ``lora_adapters``: the names of the LoRA adapters loaded now (a request may name one in
    ``lora_path``), or None when the engine serves none.

    ``grammar_check`` decides a constrained request (``json_schema``, ``regex``, ``ebnf``,
    ``structural_tag``) at submission: ``grammar_check_for(config)``, a tokenizer-free check
    of what the grammar backend accepts (a ValueError naming the field and the problem); the
    scheduler compiles and applies it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int,
                 rng: random.Random, limits: RequestLimits, pool_tokens: Optional[int] = None,
                 grammar_check: Callable[[Constraint], None] = check_grammar,
                 routed_experts_refusal: Optional[str] = NOT_RECORDED,
                 lora_adapters: Optional[Callable[[], Mapping[str, Any]]] = None) -> None:
        self.tokenizer = tokenizer
        self.lora_adapters = lora_adapters
        self.limits = limits
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.rng = rng
        self.pool_tokens = pool_tokens
        self.grammar_check = grammar_check
        self.routed_experts_refusal = routed_experts_refusal

    def check_constraint(self, constraint: Constraint) -> None:
        """Whether this engine takes ``constraint`` (ValueError naming its field if not); the
        OpenAI layer asks before translating response_format / tools into sampling_params."""
        self.grammar_check(constraint)

    def build(self, prompt: Any = None, input_ids: Any = None,
              sampling_params: Any = None, return_logprob: Any = False,
              top_logprobs_num: Any = 0, logprob_start_len: Any = -1,
              stream: bool = False, rid: Any = None, extra_key: Any = None,
              *, cache_salt: Any = None, token_ids_logprob: Any = None,
              token_ids_logprob_positions: Any = None, return_routed_experts: Any = False,
              routed_experts_start_len: Any = 0, lora_path: Any = None,
              bootstrap: Optional[dict[str, Any]] = None
              ) -> tuple[list[GenerateReq], bool]:
        """Validate a generate call and expand it (batch, n) into scheduler requests.

        The supported fields of SGLang's ``GenerateReqInput`` (``compat/fields.py``), with its
        batch rules: a scalar applies to every prompt, a list gives one value per prompt, and a
        string ``rid`` for a batch names the prompts ``<rid>_<i>``; ``n > 1`` samples of a
        prompt named ``r`` are ``r-<j>``. Each request's ``groups`` are the names it was
        expanded from (the batch's string rid, then its prompt's rid when it is a sample), so
        aborting one of them stops every member. ``extra_key`` and ``cache_salt`` together name
        the prefix-cache namespace. ``token_ids_logprob``: ids whose logprobs every output (and
        prompt) position reports (one list for all prompts, or one per prompt);
        ``token_ids_logprob_positions``: for scoring a prompt (``max_new_tokens`` 0,
        ``logprob_start_len`` 0), the ids of each prompt position (``selected_ids.py``).
        ``return_routed_experts`` (per prompt like the logprob flags): the experts every token
        fed to the model was routed to, from position ``routed_experts_start_len`` (in
        ``[0, prompt length]``) on, with the final output; refused (``routed_experts_refusal``)
        unless the engine records them. ``lora_path``: the name of a loaded LoRA adapter (or
        one per prompt; None: the base model), as SGLang's field names it. ``bootstrap``:
        SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (scalars or one
        per prompt), set by a PD router on both servers of a pair: sample ``j`` of ``n > 1``
        takes room ``<room>-<j>``; without a ``sampling_seed`` the seed is drawn from the room,
        so both servers of the pair sample alike.

        Returns the requests and whether the caller asked for a single (non-list) answer.
        Raises ValueError naming the bad field; nothing is submitted then.
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else prompt
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt: must be a string or a list of strings")
            if not texts:
                raise ValueError("prompt: the batch is empty")
            if any(t == "" for t in texts):
                raise ValueError("prompt: must not be empty")
            ids_list = [self._encode(t) for t in texts]
        else:
            single = isinstance(input_ids, list) and (
                not input_ids or not isinstance(input_ids[0], list))
            ids_list = [input_ids] if single else input_ids
            if not isinstance(ids_list, list) or not ids_list:
                raise ValueError("input_ids: must be a list of token ids or a list of such lists")
            for ids in ids_list:
                if not isinstance(ids, list) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("input_ids: must contain only integer token ids")
        nb = len(ids_list)
        params = _per_item(sampling_params, nb, "sampling_params", dict)
        sps = [SamplingParams.from_dict(p) for p in params]
        for sp in sps:
            self.limits.check_stops(sp.stop, sp.stop_token_ids)
        checked: set[tuple[str, str]] = set()
        for sp in sps:
            c = sp.constraint
            if c is not None and c.key not in checked:
                self.check_constraint(c)
                checked.add(c.key)
        if sum(sp.n for sp in sps) > MAX_REQUESTS_PER_CALL:
            raise ValueError(f"n: the call expands to {sum(sp.n for sp in sps)} requests "
                             f"(prompts x n); at most {MAX_REQUESTS_PER_CALL} per call")
        flags = [_per_item(return_logprob, nb, "return_logprob", bool),
                 _per_item(top_logprobs_num, nb, "top_logprobs_num", int),
                 _per_item(logprob_start_len, nb, "logprob_start_len", int),
                 _per_item(return_routed_experts, nb, "return_routed_experts", bool),
                 _per_item(routed_experts_start_len, nb, "routed_experts_start_len", int)]
        batch_groups: tuple[str, ...] = ()
        if isinstance(rid, str) and not single:
            batch_groups = (rid,)
            rid = [f"{rid}_{i}" for i in range(nb)]
        rids = _per_item(rid, nb, "rid", str) if rid is not None else [None] * nb
        keys = _cache_namespaces(_per_item(extra_key, nb, "extra_key", str),
                                 _per_item(cache_salt, nb, "cache_salt", str))
        adapters = self._adapters(_per_item(lora_path, nb, "lora_path", str))
        boots = _bootstraps(bootstrap or {}, nb)
        chosen = per_prompt_ids(token_ids_logprob, nb, self.vocab_size)
        positions = per_prompt_positions(token_ids_logprob_positions, nb, single,
                                         self.vocab_size)
        reqs: list[GenerateReq] = []
        for i, (ids, sp) in enumerate(zip(ids_list, sps)):
            rl, tln, lsl, rre, res = (f[i] for f in flags)
            self._validate(ids, sp, tln, lsl)
            self._check_routed_experts(ids, bool(rre), res)
            if positions[i] is not None:
                check_scoring(ids, sp, bool(rl), lsl, positions[i], chosen[i])
            base_rid = rids[i] or uuid.uuid4().hex
            base_seed = sp.sampling_seed if sp.sampling_seed is not None else (
                self.rng.getrandbits(63) if boots[i] is None else _room_seed(boots[i].room))
            groups = batch_groups if sp.n == 1 else (*batch_groups, base_rid)
            for j in range(sp.n):
                seed = base_seed if sp.n == 1 else derive_seed(base_seed, j)
                reqs.append(GenerateReq(
                    rid=base_rid if sp.n == 1 else f"{base_rid}-{j}", input_ids=list(ids),
                    sampling_params=sp, seed=seed,
                    return_logprob=bool(rl or tln or chosen[i] is not None),
                    top_logprobs_num=tln, logprob_start_len=lsl, stream=stream,
                    extra_key=keys[i], groups=groups, token_ids_logprob=chosen[i],
                    token_ids_logprob_positions=positions[i],
                    return_routed_experts=bool(rre), routed_experts_start_len=res,
                    lora_name=adapters[i], bootstrap=_sample_boot(boots[i], sp.n, j)))
        return reqs, single and sps[0].n == 1

    def _adapters(self, names: list[Optional[str]]) -> list[Optional[str]]:
        """Each prompt's adapter, checked against those loaded now ("" is the base model)."""
        names = [n or None for n in names]
        asked = sorted({n for n in names if n is not None})
        if not asked:
            return names
        if self.lora_adapters is None:
            raise ValueError("lora_path: this server serves no LoRA adapters; start it with "
                             "--enable-lora (or --lora-paths)")
        loaded = self.lora_adapters()
        unknown = [n for n in asked if n not in loaded]
        if unknown:
            raise ValueError(f"lora_path: no adapter named {unknown[0]!r} is loaded (loaded: "
                             f"{sorted(loaded)}); load it with /load_lora_adapter first")
        return names

    def _encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"prompt: not valid Unicode text ({e.reason} at index {e.start})"
                             ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _validate(self, ids: list[int], sp: SamplingParams, top_logprobs_num: int,
                  logprob_start_len: int) -> None:
        if not ids:
            raise ValueError("input_ids: the prompt is empty (it has no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        sp.verify(self.vocab_size)
        if len(ids) + sp.max_new_tokens > self.context_len:
            raise ValueError(
                f"max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens "
                f"({sp.max_new_tokens}) exceeds the context length ({self.context_len})")
        pool = self.pool_tokens
        if pool is not None and len(ids) > pool:
            raise ValueError(f"input_ids: the prompt ({len(ids)} tokens) is longer than the KV "
                             f"pool ({pool} tokens, max_total_num_tokens); shorten it or raise "
                             "max_total_tokens")
        if pool is not None and len(ids) + sp.max_new_tokens > pool:
            raise ValueError(
                f"max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens "
                f"({sp.max_new_tokens}) exceeds the KV pool ({pool} tokens, "
                "max_total_num_tokens); lower max_new_tokens or raise max_total_tokens")
        if not 0 <= top_logprobs_num <= self.vocab_size:
            raise ValueError(f"top_logprobs_num: must be in [0, {self.vocab_size}] (the "
                             "vocabulary size)")
        self.limits.check_top_logprobs(top_logprobs_num)
        if not -1 <= logprob_start_len < len(ids):
            raise ValueError(f"logprob_start_len: must be -1 or in [0, {len(ids)}) for this prompt")

    def _check_routed_experts(self, ids: list[int], asked: bool, start_len: int) -> None:
        if asked and self.routed_experts_refusal is not None:
            raise ValueError(f"return_routed_experts: {self.routed_experts_refusal}")
        if start_len < 0:
            raise ValueError(f"routed_experts_start_len: must be >= 0, got {start_len}")
        if start_len > len(ids):
            raise ValueError(f"routed_experts_start_len: {start_len} is higher than the number "
                             f"of input tokens ({len(ids)}); it must be in [0, {len(ids)}]")


def bootstrap_fields(body: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """SGLang's three bootstrap fields of a request body, for ``RequestBuilder.build``."""
    fields = {"host": body.get("bootstrap_host"), "port": body.get("bootstrap_port"),
              "room": body.get("bootstrap_room")}
    return None if all(v is None for v in fields.values()) else fields


def _bootstraps(fields: dict[str, Any], nb: int) -> list[Optional[Bootstrap]]:
    """Each prompt's ``Bootstrap`` from SGLang's three fields (all given, or none)."""
    hosts = _per_item(fields.get("host"), nb, "bootstrap_host", str)
    ports = _per_item(fields.get("port"), nb, "bootstrap_port", int)
    rooms = fields.get("room")
    rooms = rooms if isinstance(rooms, list) else [rooms] * nb
    if len(rooms) != nb:
        raise ValueError(f"bootstrap_room: list has {len(rooms)} entries for a batch of {nb}")
    out: list[Optional[Bootstrap]] = []
    for host, port, room in zip(hosts, ports, rooms):
        given = [v is not None and v != 0 for v in (host, port)] + [room is not None]
        if not any(given):
            out.append(None)
            continue
        if not all(given):
            raise ValueError("bootstrap_host, bootstrap_port and bootstrap_room: give all "
                             "three (a PD router sets them) or none")
        if isinstance(room, bool) or not isinstance(room, (int, str)) or room == "":
            raise ValueError(f"bootstrap_room: must be an integer or a string, got {room!r}")
        if not 0 < port < 65536:
            raise ValueError(f"bootstrap_port: must be a TCP port, got {port}")
        out.append(Bootstrap(host, port, str(room), bool(fields.get("resample"))))
    return out


def _sample_boot(boot: Optional[Bootstrap], n: int, j: int) -> Optional[Bootstrap]:
    """Sample ``j`` of ``n``'s room: the prompt's own for one sample, ``<room>-<j>`` else."""
    if boot is None or n == 1:
        return boot
    return Bootstrap(boot.host, boot.port, f"{boot.room}-{j}", boot.resample)


def _room_seed(room: str) -> int:
    """A seed both servers of a PD pair derive from the room they share."""
    return int.from_bytes(hashlib.sha256(room.encode()).digest()[:8], "big") >> 1


def _cache_namespaces(extra_keys: list[Optional[str]], salts: list[Optional[str]]
                      ) -> list[Optional[str]]:
    """One prefix-cache namespace per prompt from SGLang's two fields (empty means none)."""
    out: list[Optional[str]] = []
    for key, salt in zip(extra_keys, salts):
        parts = [p or "" for p in (key, salt)] if salt else [key or ""]
        out.append("\x1f".join(parts) or None)
    return out


def _per_item(value: Any, n: int, name: str, kind: type) -> list[Any]:
    """A scalar applies to every item of a batch; a list must have one entry per item."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name}: list has {len(value)} entries for a batch of {n}")
        items = value
    else:
        items = [value] * n
    for v in items:
        if v is None:
            continue
        if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{name}: must be an integer, got {v!r}")
        if kind is bool and not isinstance(v, bool):
            raise ValueError(f"{name}: must be a boolean, got {v!r}")
        if kind is dict and not isinstance(v, dict):
            raise ValueError(f"{name}: must be an object, got {type(v).__name__}")
        if kind is str and not isinstance(v, str):
            raise ValueError(f"{name}: must be a string, got {v!r}")
    defaults = {int: 0, bool: False}
    return [defaults.get(kind) if v is None and kind in defaults else v for v in items]
