"""Incremental, UTF-8-safe detokenization and stop-string trimming.

A stream's deltas must concatenate to the final text, ``decode(output_ids)`` trimmed at the stop
string. Two things make that hard: a byte-level token can end inside a multi-byte character (the
tail decodes to U+FFFD until the next token completes it), and some tokenizers rewrite earlier
text when a later token arrives (``clean_up_tokenization_spaces`` turns ``"a ."`` into ``"a."``).

Decoding re-reads a window that starts a few tokens back, at a boundary where no character is
split (SGLang / vLLM's prefix and read offsets)::

    ids:   [ ... committed ... | context (>= CONTEXT_TOKENS) | newest ]
                               ^ prefix_offset               ^ read_offset
    text  = committed_text[:-len(decode(context))] + decode(context + newest)

so a change anywhere in the window replaces the window's old text, and each step decodes a few
tokens instead of the whole sequence. The string work is per window too: the committed text is
an append-only rope, and the U+FFFD, hold-back, stop-string and emitted-prefix checks read only
its last characters (a stop string cannot start inside text already shown, which was held back
until it could not grow into one). Text is shown only once no later token can change it: no
trailing U+FFFD, no unfinished run of byte-fallback tokens, nothing that could still grow into a
stop string, and, for a tokenizer that rewrites earlier text, not the last
``REWRITE_HOLD_CHARS`` characters (``DecodeTraits``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 8        # the decode window re-reads at least this many earlier tokens
REWRITE_HOLD_CHARS = 8    # longest rewrite of transformers' space cleanup (" n ' t" -> "n't")


@dataclass(frozen=True)
class DecodeTraits:
    """What a tokenizer's decoder can do to text already decoded; found once per tokenizer.

    ``hold_chars``: characters held back while a request runs (transformers' space cleanup can
    delete a space a few characters back). ``byte_ids``: byte-fallback tokens (``<0xE4>``): a
    run of them decodes to one U+FFFD per byte, earlier bytes included, until it forms valid
    UTF-8, so text inside such a run is shown only once a normal token ends it.
    """

    hold_chars: int = 0
    byte_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tokenizer: Any) -> DecodeTraits:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        rewrites = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)
                        or getattr(decoder, "cleanup", False))
        byte_ids: frozenset[int] = frozenset()
        if "ByteFallback" in repr(decoder):
            ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
            byte_ids = frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)
        return cls(REWRITE_HOLD_CHARS if rewrites else 0, byte_ids)


class _Rope:
    """An append-only string: amortised O(1) appends and slices near its end."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.len = 0

    def append(self, piece: str) -> None:
        if piece:
            self.parts.append(piece)
            self.len += len(piece)

    def since(self, start: int) -> str:
        """``str(self)[start:]``, reading only the parts it needs."""
        need, out = self.len - max(start, 0), []
        for part in reversed(self.parts):
            if need <= 0:
                break
            out.append(part[-need:] if len(part) > need else part)
            need -= len(part)
        return "".join(reversed(out))

    def __str__(self) -> str:
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (see the module docstring).

    ``traits``: ``DecodeTraits.of(tokenizer)``, found here when not given (pass it when making
    many detokenizers for one tokenizer).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 stop: Optional[list[str]] = None, no_stop_trim: bool = False,
                 traits: Optional[DecodeTraits] = None, min_new_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop or []
        self.no_stop_trim = no_stop_trim
        self.min_new_tokens = min_new_tokens
        self._stop_from: Optional[int] = None   # see stop_from()
        self.traits = traits if traits is not None else DecodeTraits.of(tokenizer)
        self.ids: list[int] = []
        self._emitted = _Rope()    # text already returned (what the caller has)
        self._verified = 0         # emitted[:_verified] was checked against committed text
        self._stop_at: Optional[int] = None   # where the first stop string found starts
        self.finished = False
        self.drop_last = False     # the last id is a matched stop token, kept out of the text
        self.diverged = False      # a rewrite reached text already shown (logged once)
        # the decode window (see the module docstring)
        self.head = _Rope()        # text of ids[:prefix_offset], never rewritten
        self.prefix_offset = 0     # window start: a token boundary that splits no character
        self.read_offset = 0
        self.prefix_text = ""      # decode(ids[prefix_offset:read_offset])
        self.boundaries: list[int] = [0]   # recent clean boundaries, >= prefix_offset
        self.final_text: Optional[str] = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _end(self) -> int:
        return len(self.ids) - 1 if self.drop_last else len(self.ids)

    def stop_from(self) -> int:
        """Stop strings count only if they end past this many characters: the text of the first
        ``min_new_tokens - 1`` tokens, where the scheduler skipped them (and kept generating)."""
        if self._stop_from is not None:
            return self._stop_from
        k = self.min_new_tokens - 1
        if k <= 0 or not self.stop:
            return 0
        below = len(self._decode(self.ids[:k]).rstrip(_REPLACEMENT))
        if len(self.ids) >= k:
            self._stop_from = below
        return below

    def full_text(self) -> str:
        """The whole text, trimmed at the first stop string (a full decode, not the window)."""
        if self.final_text is not None:
            return self.final_text
        return trim_stop(self._decode(self.ids[:self._end()]), self.stop, self.no_stop_trim,
                         self.stop_from())

    @property
    def emitted(self) -> str:
        """The text returned so far."""
        return str(self._emitted)

    def push(self, new_ids: list[int], finished: bool, stop_token: bool = False) -> str:
        """Add tokens; return the new text that is safe to show.

        ``stop_token``: the request finished on a matched stop token (EOS or
        ``stop_token_ids``), the last of ``new_ids``; as in SGLang it stays in ``output_ids``
        but not in the text, unless ``no_stop_trim``.
        """
        self.ids.extend(new_ids)
        self.drop_last = finished and stop_token and not self.no_stop_trim and bool(self.ids)
        if finished:
            self.finished = True
            self.final_text = None
            self.final_text = self.full_text()
            return self._emit_final(self.final_text)
        base, tail = self._window_text()     # the text so far is head + tail, len(head) = base
        tail = tail.rstrip(_REPLACEMENT)
        end = base + len(tail)               # show text[:end]
        if self.traits.hold_chars:
            end = max(end - self.traits.hold_chars, 0)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            if self._stop_at is None:
                lo = max(min(self._emitted.len, end) - longest, 0)
                cut = _first_stop(self._slice(base, tail, lo, end), self.stop,
                                  self.stop_from() - lo)
                self._stop_at = None if cut is None else lo + cut   # the first stays the first
            if self._stop_at is not None:
                end = end if self.no_stop_trim else min(end, self._stop_at)
            else:
                # hold back a tail that could still grow into a stop string
                if longest > 1:
                    end = min(end, max(self._emitted.len, end - (longest - 1)))
        return self._emit(base, tail, end)

    def _slice(self, base: int, tail: str, start: int, end: int) -> str:
        """``(head + tail)[start:end]`` for ``start`` near the end."""
        if start >= base:
            return tail[start - base:end - base]
        return (self.head.since(start) + tail)[:max(end - start, 0)]

    def _window_text(self) -> tuple[int, str]:
        """``(len(head), tail)``: the text of every id so far is ``head + tail``; decodes only
        the window, and commits a clean boundary (moving text from the window to the head)."""
        end = self._end()
        if end and self.ids[end - 1] in self.traits.byte_ids:
            # inside a run of byte tokens: only the text before it is sure
            return self.head.len, self.prefix_text
        window = self._decode(self.ids[self.prefix_offset:end])
        if end > self.read_offset and not window.endswith(_REPLACEMENT):
            # ``end`` splits no character: the next window may start here
            self.read_offset, self.prefix_text = end, window
            self.boundaries.append(end)
            starts = [b for b in self.boundaries if end - b >= CONTEXT_TOKENS]
            if starts and starts[-1] != self.prefix_offset:
                # move the window up only where its text is a suffix of the old window (a
                # rewrite across that boundary, e.g. "a ' b" -> "a'b", would misalign it)
                prefix_text = self._decode(self.ids[starts[-1]:end])
                if len(prefix_text) <= len(window) and window.endswith(prefix_text):
                    self.head.append(window[:len(window) - len(prefix_text)])
                    self.prefix_offset, self.prefix_text = starts[-1], prefix_text
                    window = prefix_text
            self.boundaries = [b for b in self.boundaries if b >= self.prefix_offset]
        return self.head.len, window

    def _emit(self, base: int, tail: str, end: int) -> str:
        """Show ``text[:end]`` (text = head + tail): return what the caller does not have."""
        shown = self._emitted.len
        n = min(end, shown)
        if n > self._verified and not self.diverged:
            lo = self._verified
            if self._slice(base, tail, lo, n) != self._emitted.since(lo)[:n - lo]:
                self._diverge(self._emitted.since(max(shown - 20, 0)),
                              self._slice(base, tail, max(end - 40, 0), end))
        delta = self._slice(base, tail, shown, end) if end > shown else ""
        self._emitted.append(delta)
        # the head is never rewritten: what was shown of it stays checked
        self._verified = max(self._verified, min(base, self._emitted.len))
        return delta

    def _emit_final(self, text: str) -> str:
        emitted = str(self._emitted)
        n = min(len(text), len(emitted))
        if text[:n] != emitted[:n] and not self.diverged:
            self._diverge(emitted[-20:], text[-40:])
        delta = text[len(emitted):]
        self._emitted.append(delta)
        return delta

    def _diverge(self, shown: str, text: str) -> None:
        # shown text cannot be taken back; keep streaming from the same character count
        self.diverged = True
        logger.warning("detokenizer: a later token rewrote text already streamed "
                       "(%r is no longer a prefix of %r)", shown, text)


def _first_stop(text: str, stop: list[str], ends_after: int = 0) -> Optional[int]:
    hits = [i for i in (text.find(s, max(ends_after - len(s) + 1, 0)) for s in stop) if i >= 0]
    return min(hits) if hits else None


def trim_stop(text: str, stop: list[str], no_stop_trim: bool = False,
              ends_after: int = 0) -> str:
    """Cut ``text`` at the first stop string that ends past ``ends_after`` characters (the stop
    string itself is removed)."""
    cut = _first_stop(text, stop, ends_after)
    if cut is None or no_stop_trim:
        return text
    return text[:cut]
