"""The tiny models' tokenizer: a built-in deterministic corpus and the byte-level BPE trained on it.

The corpus (English-like prose, arithmetic and code) comes from a fixed seed, so the tokenizer is
the same on every machine without downloading anything; it depends only on the vocab size.
"""

from __future__ import annotations

import itertools
import json
import random

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

__all__ = ["SPECIAL_TOKENS", "build_tokenizer", "corpus_lines", "tokenizer_files"]

# The trainer gives special tokens the first ids, in this order.
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID = range(5)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through back "
    "much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why "
    "things help put years different away again off went old number great tell men say small "
    "every found still between name should home big give air line set own under read last never "
    "us left end along while might next sound below saw something thought both few those always "
    "looked show large often together asked house world going want school important until form "
    "food keep children feet land side without boy once animals life enough took sometimes four "
    "head above kind began almost live page got earth need far hand high year mother light parts "
    "country father let night following picture being study second eyes soon times story boys "
    "since white days ever paper hard near sentence better best across during today others sure "
    "means knew its try told young miles sun ways thing whole hear example heard several change "
    "answer room sea against top turned learn point city play toward five using himself usually"
).split()
_ONSETS = "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sh sk sl sp st th tr".split()
_VOWELS = "a e i o u y ai au ea ee ie oa oo ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rk", "st", "x"]
_UNICODE = (
    "café naïve über façade résumé 東京 北京 日本語 学生 привет мир γειά σου 😀 🚀 ✓ →".split()
)
_IDENTS = "x y i j n k idx value result items count total buf node key data acc".split()


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.choice((1, 2, 2, 3, 3, 4))
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )


def _sentence(rng: random.Random, lexicon: list[str], cum_weights: list[float]) -> str:
    words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(4, 16))
    if rng.random() < 0.05:
        words.insert(rng.randrange(len(words)), rng.choice(_UNICODE))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....?!")


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}={result}"


def _code(rng: random.Random, lexicon: list[str]) -> str:
    name = "_".join(rng.choice(lexicon[:400]) for _ in range(rng.randint(1, 3)))
    a, b = rng.sample(_IDENTS, 2)
    num = rng.randint(0, 100)
    return rng.choice(
        (
            f"def {name}({a}, {b}):\n    return {a} + {b} * {num}\n",
            f"for {a} in range({num}):\n    {b} += {a}\n",
            f"{name} = [{num}, {num + 1}, {num * 2}]\n",
            f"if {a} > {num}:\n    print('{name}', {a})\n",
            f'{{"{name}": {num}, "{a}": "{b}"}}\n',
            f"class {name.title().replace('_', '')}:\n    {a}: int = {num}\n",
        )
    )


def corpus_lines(num_lines: int = 4_000, seed: int = 0) -> list[str]:
    """Return `num_lines` lines of mixed prose, arithmetic and code; same seed, same lines."""
    rng = random.Random(seed)
    lexicon = list(_WORDS)
    seen = set(lexicon)
    while len(lexicon) < 20_000:
        word = _pseudo_word(rng)
        if word not in seen:
            seen.add(word)
            lexicon.append(word)
    # Zipf weights: real words (listed first) are drawn far more often, so their merges come first,
    # and the long tail still supplies enough distinct words for a 32k vocabulary.
    cum_weights = list(itertools.accumulate(1.0 / rank for rank in range(1, len(lexicon) + 1)))
    lines = []
    for _ in range(num_lines):
        kind = rng.random()
        if kind < 0.75:
            lines.append(
                " ".join(_sentence(rng, lexicon, cum_weights) for _ in range(rng.randint(1, 3)))
            )
        elif kind < 0.9:
            lines.append(" ".join(_arithmetic(rng) for _ in range(rng.randint(1, 4))))
        else:
            lines.append(_code(rng, lexicon))
    return lines


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on the built-in corpus; exactly `vocab_size` ids, specials first.

    The pipeline (NFC, Qwen2 split regex, byte-level) is Qwen2's because transformers v5 rebuilds
    any model_type=qwen2 tokenizer with that pipeline; using it everywhere keeps `tokenizers` and
    `AutoTokenizer` identical for every arch. Any NFC text round-trips through encode/decode.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    # The corpus may run out of merges; filler tokens keep len(tokenizer) == the model's vocab.
    num_fill = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens(
        [AddedToken(f"<|extra_{i}|>", special=True) for i in range(num_fill)]
    )
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, "the trainer must put specials first"
    return tokenizer


def tokenizer_files(vocab_size: int, model_max_length: int) -> dict[str, str]:
    """File name -> contents for tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    specials = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    special_tokens_map = {**specials, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    tokenizer_config = {
        **specials,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,  # else transformers' Qwen2Tokenizer adds <|endoftext|> past the vocab
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": build_tokenizer(vocab_size).to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n",
        "special_tokens_map.json": json.dumps(special_tokens_map, indent=2, sort_keys=True) + "\n",
    }
