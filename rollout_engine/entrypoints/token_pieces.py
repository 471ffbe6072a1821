"""Single tokens as OpenAI logprob entries show them: exact bytes, and a string that keeps two
different tokens apart even when each holds only part of a UTF-8 character.

A byte-level BPE token (GPT-2, Qwen, Llama 3) is a string over a printable alphabet that stands
for raw bytes; ``tokenizer.decode([id])`` of a partial character gives U+FFFD for every such
token, so top-logprob dicts keyed by it would collide. Like OpenAI, a token whose bytes are not
valid UTF-8 is shown as ``"bytes:\\xe2\\x80"``.
"""

from __future__ import annotations

import codecs
import re
from typing import Any, Optional

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # sentencepiece byte-fallback tokens


def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map from printable characters back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenPieces:
    """``piece(id) -> (text, bytes)``, cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_decoder = _byte_decoder()
        self.special = set(getattr(tokenizer, "all_special_ids", []))
        self.added = set(tokenizer.get_added_vocab().values()) if hasattr(
            tokenizer, "get_added_vocab") else set()
        self.cache: dict[int, tuple[str, bytes]] = {}

    def _raw(self, token_id: int) -> bytes:
        tok = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(tok, str) or token_id in self.special or token_id in self.added:
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        if self.byte_level and all(ch in self.byte_decoder for ch in tok):
            return bytes(self.byte_decoder[ch] for ch in tok)
        m = _HEX_BYTE.fullmatch(tok)
        if m:
            return bytes([int(m.group(1), 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def piece(self, token_id: int) -> tuple[str, bytes]:
        hit = self.cache.get(token_id)
        if hit is None:
            raw = self._raw(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self.cache[token_id] = (text, raw)
        return hit


class TextOffsets:
    """OpenAI's legacy ``text_offset``: how many characters of text come before each token,
    counting the UTF-8 bytes of the tokens so far with invalid and unfinished sequences left
    out (``len(b"".join(earlier).decode("utf-8", "ignore"))``). Kept incrementally, so a
    token costs its own bytes, not the whole text's; one object per choice, carried across a
    stream's chunks."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._clean = True   # the decoder holds no unfinished character
        self.chars = 0

    def push(self, raw: bytes) -> int:
        """The offset before a token of bytes ``raw``; the token is then counted."""
        at = self.chars
        if self._clean:   # whole characters so far: a valid token counts on its own
            if raw.isascii():
                self.chars += len(raw)
                return at
            try:
                self.chars += len(raw.decode("utf-8"))
                return at
            except UnicodeDecodeError:
                pass
        self.chars += len(self._decoder.decode(raw))
        self._clean = not self._decoder.getstate()[0]
        return at


LOGPROB_FLOOR = -9999.0


def floor_logprob(lp: Optional[float]) -> Optional[float]:
    """A logprob as the OpenAI routes show it: vLLM's floor of -9999 for ``-inf`` (a token
    the processed distribution masks; JSON has no infinity), NaN likewise; null stays null
    (the first prompt token has none)."""
    if lp is None:
        return None
    return lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR


def legacy_logprobs(pieces: TokenPieces, entries: list[list[Any]], tops: Optional[list[Any]],
                    offsets: Optional[TextOffsets] = None) -> dict[str, Any]:
    """``/v1/completions``' logprobs shape from ``[logprob, id, text]`` entries: parallel
    lists of tokens, logprobs, top-logprob dicts (each also holding the chosen token) and
    text offsets. ``offsets``: the choice's text so far (a stream passes the same one with
    every chunk), advanced past these tokens."""
    piece = pieces.piece
    offsets = TextOffsets() if offsets is None else offsets
    tokens: list[str] = []
    top_logprobs: list[Optional[dict[str, Any]]] = []
    text_offset: list[int] = []
    for k, (lp, tid, _) in enumerate(entries):
        lp = floor_logprob(lp)
        s, raw = piece(tid)
        tokens.append(s)
        text_offset.append(offsets.push(raw))
        top = tops[k] if tops is not None and k < len(tops) else None
        if top is None:
            top_logprobs.append(None if lp is None else {s: lp})
            continue
        entry = {piece(t)[0]: floor_logprob(v) for v, t, _ in top}
        entry.setdefault(s, lp)
        top_logprobs.append(entry)
    return {"tokens": tokens, "token_logprobs": [floor_logprob(e[0]) for e in entries],
            "top_logprobs": top_logprobs, "text_offset": text_offset}
