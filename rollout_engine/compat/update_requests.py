"""The fields of SGLang's weight-update requests (``io_struct.py``'s ``*ReqInput``) that the
update control calls take as ``**sglang_flags``, with SGLang's types. They are declared here so
that the control calls' signatures (``Unpack[SglangUpdateFlags]``) type every argument an HTTP
body may carry: the control routes coerce a body to these types as SGLang's request models do."""

from __future__ import annotations

from typing import Any, Optional, TypedDict

__all__ = ["SglangFlags", "SglangUpdateFlags"]


class SglangFlags(TypedDict, total=False):
    """Fields the update calls honour trivially or refuse (``rl_control._check_flags``)."""

    is_async: bool
    recapture_cuda_graph: bool
    token_step: int
    manifest: Optional[dict[str, Any]]
    pp_rank: Optional[int]
    disable_draft_model: Optional[bool]


class SglangUpdateFlags(SglangFlags, total=False):
    """All of them: with the fields that say which model an update addresses (a draft engine
    routes them, ``control/draft_refit.py``; without a draft only the target is valid)."""

    selector: Optional[str]
    draft_model_path: Optional[str]
