"""``/v1/completions``' logprobs shape (token_pieces.legacy_logprobs): ``text_offset`` is the
character count of the earlier tokens' bytes decoded with bad and unfinished UTF-8 left out,
the same whether a choice comes whole or in stream chunks, and a token costs its own bytes
(a long completion's offsets take linear time, not quadratic)."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_engine.entrypoints.token_pieces import TextOffsets, legacy_logprobs

# "€" is e2 82 ac: its three bytes as three tokens; ff is never valid UTF-8
PIECES = {1: b"a", 2: b"\xe2", 3: b"\x82", 4: b"\xac", 5: b"\xff", 6: "é".encode(),
          7: b"\xf0\x9f", 8: b"\x98\x80", 9: b" b"}


class FakePieces:
    """``TokenPieces.piece`` over a fixed table."""

    def piece(self, token_id: int) -> tuple[str, bytes]:
        raw = PIECES[token_id]
        return raw.decode("utf-8", "replace"), raw


def _defined_offsets(raws: list[bytes]) -> list[int]:
    return [len(b"".join(raws[:k]).decode("utf-8", "ignore")) for k in range(len(raws))]


byte_pieces = st.lists(st.one_of(
    st.binary(max_size=4),
    st.sampled_from(list(PIECES.values())),
    st.text(max_size=3).map(lambda s: s.encode("utf-8", "surrogatepass")),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(byte_pieces)
def test_offsets_match_the_prefix_decode(raws: list[bytes]) -> None:
    offsets = TextOffsets()
    assert [offsets.push(r) for r in raws] == _defined_offsets(raws)
    assert offsets.chars == len(b"".join(raws).decode("utf-8", "ignore"))


def test_legacy_shape_and_offsets_through_split_characters() -> None:
    ids = [1, 2, 3, 4, 9, 5, 6, 7, 8, 1]
    entries = [[-0.1 * k, tid, None] for k, tid in enumerate(ids)]
    tops = [[[-0.5, 9, None]] for _ in ids]
    out = legacy_logprobs(FakePieces(), entries, tops)
    assert out["text_offset"] == _defined_offsets([PIECES[t] for t in ids])
    assert out["text_offset"] == [0, 1, 1, 1, 2, 4, 4, 5, 5, 6]
    assert out["tokens"] == [FakePieces().piece(t)[0] for t in ids]
    assert out["token_logprobs"] == [e[0] for e in entries]
    assert out["top_logprobs"][0] == {" b": -0.5, "a": 0.0}
    assert out["top_logprobs"][4] == {" b": -0.5}   # the chosen token is in the top list


def test_top_entries_of_tokens_without_logprobs() -> None:
    # echo: the first prompt token has no logprob; a top list may be missing or shorter
    entries = [[None, 1, None], [-0.5, 9, None], [-0.25, 6, None]]
    assert legacy_logprobs(FakePieces(), entries, None)["top_logprobs"] == [
        None, {" b": -0.5}, {"é": -0.25}]
    tops = [None, [[-0.7, 1, None]]]
    assert legacy_logprobs(FakePieces(), entries, tops)["top_logprobs"] == [
        None, {"a": -0.7, " b": -0.5}, {"é": -0.25}]
    assert legacy_logprobs(FakePieces(), entries[:1], [[[-0.7, 9, None]]])["top_logprobs"] == [
        {" b": -0.7, "a": None}]


def test_a_stream_in_chunks_equals_the_whole() -> None:
    ids = [1, 2, 3, 4, 9, 5, 6, 7, 8, 1, 2, 4]
    entries = [[-1.0, tid, None] for tid in ids]
    whole = legacy_logprobs(FakePieces(), entries, None)
    offsets = TextOffsets()
    parts = [legacy_logprobs(FakePieces(), entries[a:b], None, offsets)
             for a, b in ((0, 2), (2, 3), (3, 8), (8, 12))]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == whole[key], key


def _best_seconds(n_tokens: int) -> float:
    entries = [[-1.0, 6 if k % 3 else 2, None] for k in range(n_tokens)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        legacy_logprobs(FakePieces(), entries, None)
        best = min(best, time.perf_counter() - t0)
    return best


def test_offsets_take_linear_time() -> None:
    # 10x the tokens: ~10x the time when each token costs its own bytes, ~100x when every
    # offset decodes the whole text so far (what a 16k-token completion must not do)
    small, large = _best_seconds(2_000), _best_seconds(20_000)
    assert large / small < 30, (small, large)
