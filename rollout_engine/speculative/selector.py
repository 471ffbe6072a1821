"""Which model a weight update is for (``selector``, SGLang's field; module
``control/draft_refit.py`` says how names route). No engine imports: ``control/rl_control.py``
checks the target-only case with it for engines without a draft.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["DRAFT_PREFIX", "SELECTORS", "check_target_only", "resolve_selector"]

DRAFT_PREFIX = "draft."
SELECTORS = ("target", "draft", "all")


def resolve_selector(selector: Optional[str], disable_draft_model: Optional[bool] = None) -> str:
    """The update's selector (None: ``"all"``); ``disable_draft_model`` true is ``"target"``."""
    if selector is not None and selector not in SELECTORS:
        raise ValueError(f"selector: must be one of {list(SELECTORS)} or null, got {selector!r}")
    if disable_draft_model:
        if selector == "draft":
            raise ValueError("disable_draft_model and selector='draft' are mutually exclusive")
        return "target"
    return selector or "all"


def check_target_only(selector: Optional[str], draft_model_path: Optional[str]) -> None:
    """An engine without a draft model: only the target can be refit."""
    if selector is not None and selector not in SELECTORS:
        raise ValueError(f"selector: must be one of {list(SELECTORS)} or null, got {selector!r}")
    if selector == "draft" or draft_model_path is not None:
        field = "selector" if selector == "draft" else "draft_model_path"
        raise ValueError(f"{field}: this engine has no draft model to refit (only "
                         "speculative_algorithm STANDALONE runs one)")
