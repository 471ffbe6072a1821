"""Incremental, UTF-8-safe detokenization and stop-string trimming."""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level tokens may end in the middle of a multi-byte character; such a tail decodes to
    U+FFFD and is held back until the next tokens complete it. Decoding re-reads a short window
    of earlier tokens so that merges across token boundaries come out as a full decode would.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, no_stop_trim: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop or []
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.emitted = ""          # text already returned
        self.finished = False
        self.drop_last = False     # the last id is a matched stop token, kept out of the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _text(self) -> str:
        return self._decode(self.ids[:-1] if self.drop_last else self.ids)

    def full_text(self) -> str:
        return trim_stop(self._text(), self.stop, self.no_stop_trim)

    def push(self, new_ids: list[int], finished: bool, stop_token: bool = False) -> str:
        """Add tokens; return the new text that is safe to show.

        ``stop_token``: the request finished on a matched stop token (EOS or
        ``stop_token_ids``), the last of ``new_ids``; as in SGLang it stays in ``output_ids``
        but not in the text, unless ``no_stop_trim``.
        """
        self.ids.extend(new_ids)
        self.drop_last = finished and stop_token and not self.no_stop_trim and bool(self.ids)
        text = self._text()
        if finished:
            text = trim_stop(text, self.stop, self.no_stop_trim)
        else:
            text = text.rstrip(_REPLACEMENT)
            # hold back a tail that could still grow into a stop string
            hold = max((len(s) - 1 for s in self.stop), default=0)
            cut = _first_stop(text, self.stop)
            if cut is not None:
                text = text[:cut] if not self.no_stop_trim else text
            elif hold:
                text = text[:max(len(self.emitted), len(text) - hold)]
        if not text.startswith(self.emitted):
            # a later token changed how earlier bytes decode; never retract shown text
            return ""
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta


def _first_stop(text: str, stop: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def trim_stop(text: str, stop: list[str], no_stop_trim: bool = False) -> str:
    """Cut ``text`` at the first stop string (the stop string itself is removed)."""
    cut = _first_stop(text, stop)
    if cut is None or no_stop_trim:
        return text
    return text[:cut]
