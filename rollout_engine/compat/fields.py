"""SGLang's request surface, field for field, and what this engine does with each field.

The lists are read from SGLang's source (the spec), not guessed:

    GENERATE_REQUEST   io_struct.py  GenerateReqInput   (/generate bodies; Engine.generate kwargs)
    SAMPLING_PARAMS    sampling/sampling_params.py  SamplingParams
    COMPLETION_REQUEST entrypoints/openai/protocol.py  CompletionRequest  (/v1/completions)
    CHAT_REQUEST       entrypoints/openai/protocol.py  ChatCompletionRequest (/v1/chat/completions)

plus the few names the sglang-router's typed requests add (``sampling_seed`` on the OpenAI
routes, OpenAI's own ``metadata`` / ``service_tier`` / ...). Each field is one of:

    supported            mapped to one of our features (the note says which)
    accepted-if-default  null or SGLang's default value is accepted and means "not used";
                         anything else is a ValueError (HTTP 400) that names the field and
                         says it is not supported by this engine
    ignored              any value accepted, no effect: logging / metrics / routing hints that
                         change nothing about the tokens produced

A name in none of the lists (SGLang does not know it either) stays an unknown-field error.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["CHAT_REQUEST", "COMPLETION_REQUEST", "GENERATE_REQUEST", "SAMPLING_PARAMS",
           "FieldList", "SglangField", "Treatment"]


class Treatment(str, enum.Enum):
    SUPPORTED = "supported"
    DEFAULT_ONLY = "accepted-if-default"
    IGNORED = "ignored"


@dataclass(frozen=True)
class SglangField:
    """One field of an SGLang request and how this engine treats it.

    ``also_default``: other values SGLang treats as "not used" (``[]`` for ``token_ids_logprob``,
    ``0`` for ``routed_dp_rank`` on a single data-parallel rank). A list whose entries are all
    default (one per prompt of a batch: ``[null, null]``) is default too.
    ``refusal``: the message for a non-default value of an accepted-if-default field, when the
    generic one ("<field> is not supported by this engine: <note>") is not clear enough.
    """

    name: str
    default: Any
    treatment: Treatment
    note: str
    also_default: tuple[Any, ...] = ()
    refusal: Optional[str] = None

    def is_default(self, value: Any) -> bool:
        if value is None or _same(value, self.default):
            return True
        if any(_same(value, d) for d in self.also_default):
            return True
        return isinstance(value, list) and all(self.is_default(v) for v in value)

    def check(self, value: Any, prefix: str = "") -> None:
        """Raise ValueError (naming ``prefix + name``) for a value this engine cannot honour."""
        if self.treatment is not Treatment.DEFAULT_ONLY or self.is_default(value):
            return
        reason = self.refusal or f"{self.name} is not supported by this engine ({self.note})"
        raise ValueError(f"{prefix}{self.name}: {reason}; send null or the default "
                         f"({_show(self.default)}), got {_show(value)}")


def _same(a: Any, b: Any) -> bool:
    # bool is an int subclass: True must not pass as 1 (nor 1 as True), nor 0.0 as False
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _show(value: Any) -> str:
    """A value as JSON (what a client sent), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class FieldList:
    """The fields of one SGLang request type, by name."""

    def __init__(self, name: str, source: str, fields: Iterable[SglangField]) -> None:
        self.name = name
        self.source = source
        self.fields: dict[str, SglangField] = {}
        for f in fields:
            if f.name in self.fields:
                raise ValueError(f"{name}: field {f.name!r} listed twice")
            self.fields[f.name] = f

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    def __getitem__(self, name: str) -> SglangField:
        return self.fields[name]

    def __iter__(self) -> Any:
        return iter(self.fields.values())

    def __len__(self) -> int:
        return len(self.fields)

    def names(self, *treatments: Treatment) -> set[str]:
        want = set(treatments) or set(Treatment)
        return {f.name for f in self.fields.values() if f.treatment in want}

    def check(self, body: Mapping[str, Any], where: str, *, prefix: str = "",
              extra: Iterable[str] = (), unknown_ok: bool = False) -> None:
        """Refuse unknown names (unless ``unknown_ok``: a schema checks them later) and
        non-default values of accepted-if-default fields (named ``prefix + field``).
        ``extra``: names this engine adds beyond SGLang's (treated as supported)."""
        if not unknown_ok:
            allowed = set(self.fields) | set(extra)
            unknown = sorted(k for k in body if k not in allowed)
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} "
                                 f"(neither this engine nor SGLang's {self.name} has them)")
        for key, value in body.items():
            f = self.fields.get(key)
            if f is not None:
                f.check(value, prefix)

    def markdown(self) -> str:
        """The list as a table (docs/API.md carries it)."""
        rows = [f"| `{f.name}` | `{_show(f.default)}` | {f.treatment.value} | "
                f"{f.note.replace('|', '/')} |" for f in self.fields.values()]
        head = f"`{self.name}` ({self.source}): {len(self)} fields\n\n" \
               "| field | SGLang default | here | how |\n|---|---|---|---|\n"
        return head + "\n".join(rows)


S, D, X = Treatment.SUPPORTED, Treatment.DEFAULT_ONLY, Treatment.IGNORED


def _f(name: str, default: Any, treatment: Treatment, note: str, *also: Any,
       refusal: Optional[str] = None) -> SglangField:
    return SglangField(name, default, treatment, note, tuple(also), refusal)


_MULTIMODAL = "this engine serves text-only models"
_PD = "prefill/decode disaggregation"
_BOOT = ("prefill/decode disaggregation: where the decode server of a pair fetches the prompt's "
         "KV (set by the PD router; per prompt when a list)")
_DP = "one data-parallel rank (0)"
_LORA = ("the name of a loaded LoRA adapter (--enable-lora; /load_lora_adapter), one per "
         "prompt when a list; null: the base model")
_LORA_ID = ("lora_id is not supported by this engine: it is SGLang's internal id of an adapter "
            "(its tokenizer manager sets it); name the adapter with lora_path")
# checked at submission (one per request, syntax, what xgrammar accepts: a 400 naming the
# problem), compiled off the scheduler loop and applied as a token mask (--grammar-backend)
_GRAMMAR = "structured output (xgrammar; returned logprobs unmasked unless "\
    "return_masked_logprobs): "
_STRUCTURED = [
    _f("json_schema", None, S, _GRAMMAR + "a JSON schema (string or object; $$ANY$$: any JSON)"),
    _f("regex", None, S, _GRAMMAR + "a regular expression the whole output matches"),
    _f("ebnf", None, S, _GRAMMAR + "an EBNF grammar (xgrammar's dialect, root rule 'root')"),
]

# -- GenerateReqInput ---------------------------------------------------------------------------
GENERATE_REQUEST = FieldList("GenerateReqInput", "python/sglang/srt/managers/io_struct.py", [
    # supported
    _f("text", None, S, "the prompt, a string or a batch of strings (Engine.generate: prompt)"),
    _f("input_ids", None, S, "token ids, one list or a batch of lists"),
    _f("sampling_params", None, S, "an object, or one per prompt; see SamplingParams"),
    _f("rid", None, S, "request id; a list gives one per prompt, a string for a batch becomes "
       "<rid>_<i> as in SGLang; n > 1 samples are <rid>-<j>"),
    _f("return_logprob", None, S, "meta_info.output_token_logprobs [logprob, id, text|null]; "
       "per prompt when a list"),
    _f("logprob_start_len", None, S, "-1 (default): output only; k: prompt logprobs from k"),
    _f("top_logprobs_num", None, S, "top-k logprobs per position"),
    _f("return_text_in_logprobs", False, S, "the third slot of each logprob entry is the "
       "token's text"),
    _f("stream", False, S, "SSE chunks, cumulative unless incremental_streaming_output"),
    _f("extra_key", None, S, "prefix-cache namespace: requests share cached prefixes only "
       "with requests of the same key"),
    _f("cache_salt", None, S, "joins extra_key in the prefix-cache namespace"),
    # accepted if default
    _f("token_ids_logprob", None, S, "logprobs of these token ids at every output position "
       "(and prompt position from logprob_start_len): meta_info.output_token_ids_logprobs, "
       "input_token_ids_logprobs", []),
    _f("token_ids_logprob_positions", None, S, "scoring (max_new_tokens 0, logprob_start_len "
       "0): row p lists the ids whose logprobs prompt position p reports "
       "(input_token_ids_logprobs); an on-policy distillation extension"),
    _f("session_params", None, D, "continual-prompting sessions"),
    _f("input_embeds", None, D, "prompt embeddings"),
    _f("image_data", None, D, _MULTIMODAL, []),
    _f("video_data", None, D, _MULTIMODAL, []),
    _f("audio_data", None, D, _MULTIMODAL, []),
    _f("mm_hashes", None, D, _MULTIMODAL),
    _f("mm_content_hashes", None, D, _MULTIMODAL),
    _f("use_audio_in_video", False, D, _MULTIMODAL),
    _f("video_config", None, D, _MULTIMODAL),
    _f("modalities", None, D, _MULTIMODAL, []),
    _f("max_dynamic_patch", None, D, _MULTIMODAL),
    _f("min_dynamic_patch", None, D, _MULTIMODAL),
    _f("image_max_dynamic_patch", None, D, _MULTIMODAL),
    _f("video_max_dynamic_patch", None, D, _MULTIMODAL),
    _f("images_config", None, D, _MULTIMODAL),
    _f("need_wait_for_mm_inputs", None, D, "encoder disaggregation", False),
    _f("num_items_assigned", None, D, "encoder disaggregation"),
    _f("encoder_urls", None, D, "encoder disaggregation"),
    _f("return_sampling_mask", None, D, "output sampling masks", False),
    _f("return_flat_raw_top_logprobs", False, D, "flat top-logprob arrays"),
    _f("return_flat_raw_top_logprobs_b64", False, D, "flat top-logprob arrays"),
    _f("return_hidden_states", False, D, "hidden states are not returned"),
    _f("return_routed_experts", False, S, "rollout routing replay (needs "
       "--enable-return-routed-experts and a MoE model): meta_info.routed_experts, base64 "
       "int32 [tokens fed - start, num_hidden_layers, top_k], -1 in dense layers; per prompt "
       "when a list"),
    _f("routed_experts_start_len", 0, S, "first position whose routed experts are returned, "
       "in [0, prompt length]"),
    _f("return_indexer_topk", False, D, "sparse-attention indexer output"),
    _f("lora_path", None, S, _LORA),
    _f("lora_id", None, D, "LoRA", "", refusal=_LORA_ID),
    _f("custom_logit_processor", None, D, "custom logit processors (pickled code)", ""),
    _f("positional_embed_overrides", None, D, "embedding overrides"),
    _f("bootstrap_host", None, S, _BOOT),
    _f("bootstrap_port", None, S, _BOOT),
    _f("bootstrap_room", None, S, _BOOT),
    _f("bootstrap_pair_key", None, D, _PD),
    _f("decode_tp_size", None, D, _PD),
    _f("disagg_prefill_dp_rank", None, D, _PD),
    _f("routed_dp_rank", None, D, _DP, 0),
    _f("data_parallel_rank", None, D, _DP + "; SGLang's deprecated routed_dp_rank", 0),
    _f("http_worker_ipc", None, D, "SGLang-internal multi-tokenizer routing"),
    _f("background", False, D, "background responses (the Responses API)"),
    _f("require_reasoning", False, D, "hybrid reasoning models"),
    _f("max_thinking_tokens", None, D, "thinking budgets"),
    _f("return_bytes", False, D, "image generation"),
    _f("return_entropy", False, D, "per-token entropy"),
    _f("return_prompt_token_ids", False, D, "prompt ids without logprobs"),
    _f("multi_item_delimiter_indices", None, D, "multi-item scoring"),
    # ignored
    _f("session_id", None, X, "a session identity for routing; the prompt is not changed"),
    _f("log_metrics", True, X, "metrics logging flag"),
    _f("no_logs", False, X, "request logging flag (we do not log request contents)"),
    _f("custom_labels", None, X, "metric labels"),
    _f("priority", None, X, "SGLang ignores it unless priority scheduling is on; it is not here"),
    _f("routing_key", None, X, "router hint"),
    _f("kv_router_hint", None, X, "router hint for KV reuse across workers"),
    _f("conversation_id", None, X, "tracking id"),
    _f("external_trace_header", None, X, "tracing context"),
    _f("received_time", None, X, "tracing timestamp"),
    # not a GenerateReqInput field: the sglang-router (0.3.x) forwards its request struct's
    # `model` to /generate, and SGLang's parser drops keys it does not know
    _f("model", None, X, "sent by the sglang-router for multi-model routing; one model here"),
])

# -- SamplingParams -----------------------------------------------------------------------------
SAMPLING_PARAMS = FieldList("SamplingParams", "python/sglang/srt/sampling/sampling_params.py", [
    _f("max_new_tokens", 128, S, "tokens to generate at most"),
    _f("min_new_tokens", 0, S, "EOS / stop tokens / stop strings held off until this many"),
    _f("temperature", 1.0, S, "0 means greedy"),
    _f("top_p", 1.0, S, "nucleus sampling"),
    _f("top_k", -1, S, "-1 means the whole vocabulary"),
    _f("min_p", 0.0, S, "min-p filtering"),
    _f("frequency_penalty", 0.0, S, "OpenAI-style penalty"),
    _f("presence_penalty", 0.0, S, "OpenAI-style penalty"),
    _f("repetition_penalty", 1.0, S, "CTRL-style penalty"),
    _f("stop", None, S, "stop strings (a string or a list)"),
    _f("stop_token_ids", None, S, "stop tokens, kept in output_ids"),
    _f("ignore_eos", False, S, "do not stop at EOS"),
    _f("skip_special_tokens", True, S, "detokenization"),
    _f("spaces_between_special_tokens", True, S, "detokenization"),
    _f("no_stop_trim", False, S, "keep the matched stop string / token in the text"),
    _f("n", 1, S, "samples per prompt"),
    _f("sampling_seed", None, S, "per-request seed; same seed, same tokens"),
    _f("stop_regex", None, D, "stop regexes", "", []),
    *_STRUCTURED,
    _f("structural_tag", None, S, _GRAMMAR + "SGLang's structures + triggers, or xgrammar's "
       "format"),
    # not an SGLang field: our extension
    _f("return_masked_logprobs", False, S, "rollout_engine extension (not in SGLang): under a "
       "grammar, output logprobs are log_softmax over the allowed tokens (the sampled "
       "distribution) instead of the unmasked log_softmax(logits / T)"),
    _f("logit_bias", None, D, "logit bias", {}),
    _f("beam_width", None, D, "beam search (read by GenerateReqInput)", 0, 1),
    _f("custom_params", None, S, "arguments of a custom logit processor (refused); "
       "{'return_top_p_token_ids': true} (slime's, when top_p != 1) returns each output token's "
       "kept nucleus: meta_info.top_p_token_ids, top_p_token_offsets; other keys reach nothing"),
    _f("stream_interval", None, X, "chunk cadence is the server's stream_interval; the tokens "
       "are the same"),
])

# -- OpenAI routes ------------------------------------------------------------------------------
_OPENAI_COMMON = [
    _f("model", "default", S, "a loaded LoRA adapter's name, or base:adapter, selects that "
       "adapter (lora_path wins); any other name: the base model; responses carry "
       "served_model_name"),
    _f("frequency_penalty", 0.0, S, "sampling_params.frequency_penalty"),
    _f("presence_penalty", 0.0, S, "sampling_params.presence_penalty"),
    _f("logit_bias", None, D, "logit bias", {}),
    _f("n", 1, S, "sampling_params.n"),
    _f("seed", None, S, "sampling_params.sampling_seed"),
    _f("sampling_seed", None, S, "the sglang-router's name for seed"),
    _f("stop", None, S, "sampling_params.stop"),
    _f("stream", False, S, "SSE deltas, as OpenAI streams"),
    _f("stream_options", None, S, "include_usage"),
    _f("user", None, X, "end-user id"),
    _f("top_k", -1, S, "sampling_params.top_k"),
    _f("min_p", 0.0, S, "sampling_params.min_p"),
    _f("min_tokens", 0, S, "sampling_params.min_new_tokens"),
    _f("repetition_penalty", 1.0, S, "sampling_params.repetition_penalty"),
    _f("stop_token_ids", None, S, "sampling_params.stop_token_ids"),
    _f("no_stop_trim", False, S, "sampling_params.no_stop_trim"),
    _f("ignore_eos", False, S, "sampling_params.ignore_eos"),
    _f("skip_special_tokens", True, S, "sampling_params.skip_special_tokens"),
    _f("rid", None, S, "request id(s)"),
    _f("extra_key", None, S, "prefix-cache namespace"),
    _f("cache_salt", None, S, "joins extra_key in the prefix-cache namespace"),
    _f("return_hidden_states", False, D, "hidden states are not returned"),
    _f("return_routed_experts", False, S, "rollout routing replay (needs "
       "--enable-return-routed-experts and a MoE model): sglext.routed_experts of the first "
       "choice (and of each finishing stream chunk), as /generate's meta_info.routed_experts"),
    _f("routed_experts_start_len", 0, S, "first position whose routed experts are returned, "
       "in [0, prompt length]"),
    _f("return_cached_tokens_details", False, D, "cache tiers (usage has cached_tokens)"),
    _f("return_token_ids", False, S, "vLLM's token_ids in each choice and prompt_token_ids"),
    _f("regex", None, S, _GRAMMAR + "sampling_params.regex"),
    _f("ebnf", None, S, _GRAMMAR + "sampling_params.ebnf"),
    _f("stop_regex", None, D, "stop regexes", "", []),
    _f("lora_path", None, S, _LORA),
    _f("session_id", None, X, "a session identity for routing"),
    _f("session_params", None, D, "continual-prompting sessions"),
    _f("custom_params", None, X, "arguments of a custom logit processor (refused)"),
    _f("custom_logit_processor", None, D, "custom logit processors (pickled code)", ""),
    _f("images_config", None, D, _MULTIMODAL),
    _f("bootstrap_host", None, S, _BOOT),
    _f("bootstrap_port", None, S, _BOOT),
    _f("bootstrap_room", None, S, _BOOT),
    _f("routed_dp_rank", None, D, _DP, 0),
    _f("disagg_prefill_dp_rank", None, D, _PD),
    _f("data_parallel_rank", None, D, _DP + "; SGLang's deprecated routed_dp_rank", 0),
    _f("ngram_corpus_id", None, X, "n-gram speculative decoding corpus (lossless; none here)"),
    _f("priority", None, X, "priority scheduling is off, as SGLang's default"),
    _f("custom_labels", None, X, "metric labels"),
]

_TEXT_FORMAT = {"type": "text"}

COMPLETION_REQUEST = FieldList(
    "CompletionRequest", "python/sglang/srt/entrypoints/openai/protocol.py", [
        _f("prompt", None, S, "text, a batch of texts, token ids, or a batch of token ids"),
        _f("best_of", None, S, "only best_of == n (no reranking)"),
        _f("echo", False, S, "prepends the prompt (and its logprobs)"),
        _f("logprobs", None, S, "top logprobs per token (legacy shape)"),
        _f("max_tokens", 16, S, "sampling_params.max_new_tokens"),
        _f("suffix", None, D, "insertion (fill-in-the-middle)", ""),
        _f("temperature", 1.0, S, "sampling_params.temperature"),
        _f("top_p", 1.0, S, "sampling_params.top_p"),
        _f("json_schema", None, S, _GRAMMAR + "sampling_params.json_schema"),
        _f("response_format", None, S, _GRAMMAR + "text (none), json_object, json_schema or "
           "structural_tag", _TEXT_FORMAT),
        *_OPENAI_COMMON,
    ])

CHAT_REQUEST = FieldList(
    "ChatCompletionRequest", "python/sglang/srt/entrypoints/openai/protocol.py", [
        _f("messages", None, S, "rendered by the model's chat template"),
        _f("logprobs", False, S, "choices[].logprobs.content"),
        _f("top_logprobs", None, S, "alternatives per token, at most --max-top-logprobs-num "
           "(default 20)"),
        _f("max_tokens", None, S, "sampling_params.max_new_tokens"),
        _f("max_completion_tokens", None, S, "sampling_params.max_new_tokens (wins)"),
        _f("temperature", None, S, "sampling_params.temperature"),
        _f("top_p", None, S, "sampling_params.top_p"),
        _f("continue_final_message", False, S, "chat template: continue the last message"),
        _f("chat_template_kwargs", None, S, "extra chat template arguments"),
        _f("input_ids", None, S, "pre-tokenized prompt; the chat template is skipped"),
        _f("reasoning_effort", None, S, "sets chat_template_kwargs thinking / enable_thinking "
           "(false for 'none') unless given, as SGLang does"),
        _f("response_format", None, S, _GRAMMAR + "text (none), json_object, json_schema or "
           "structural_tag", _TEXT_FORMAT),
        _f("tools", None, S, "rendered by the chat template; calls in the output (the "
           "--tool-call-parser format: qwen / qwen25 / hermes <tool_call> blocks, llama3 JSON; "
           "<tool_call> blocks without one) become message.tool_calls", []),
        _f("tool_choice", "auto", S, "auto / none; required or a named function force a call "
           "with a grammar (a structural tag over calls in the --tool-call-parser format)", "none"),
        _f("parallel_tool_calls", True, S, "false: only the first tool call is returned"),
        _f("return_prompt_token_ids", False, S, "choices[i].prompt_token_ids: the prompt's ids "
           "(not with stream)"),
        _f("return_meta_info", False, S, "choices[i].meta_info: /generate's meta_info (token "
           "logprobs with logprobs = true, completion_tokens, finish_reason; not with stream)"),
        _f("task", None, D, "DeepSeek-V4 quick instructions"),
        _f("separate_reasoning", True, S, "with --reasoning-parser: the think block comes back "
           "as reasoning_content (false: left in content); without one, nothing is split"),
        _f("stream_reasoning", True, S, "with --reasoning-parser: delta.reasoning_content as it "
           "comes (false: in one piece when the block ends)"),
        _f("max_dynamic_patch", None, D, _MULTIMODAL),
        _f("min_dynamic_patch", None, D, _MULTIMODAL),
        _f("use_audio_in_video", False, D, _MULTIMODAL),
        # OpenAI names the sglang-router's chat request carries when a client sets them
        _f("metadata", None, X, "OpenAI dashboard tags"),
        _f("service_tier", None, X, "OpenAI billing tier"),
        _f("prompt_cache_key", None, X, "OpenAI cache routing hint"),
        _f("safety_identifier", None, X, "OpenAI moderation id"),
        _f("verbosity", None, D, "OpenAI verbosity control"),
        _f("modalities", None, D, _MULTIMODAL, ["text"]),
        _f("function_call", None, D, "tool calling (deprecated OpenAI form)", "none"),
        _f("functions", None, D, "tool calling (deprecated OpenAI form)", []),
        *_OPENAI_COMMON,
    ])
