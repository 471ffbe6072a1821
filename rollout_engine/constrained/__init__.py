"""Grammar-constrained generation: constraints, the xgrammar backend, masks.

``spec`` (what a request asks for, checked without xgrammar), ``backend`` (check and compile,
off the scheduler loop, cached), ``matcher`` (per-request state, the batch mask and the
contract the scheduler and sampler follow), ``pending`` (requests waiting for a compile).
"""

from rollout_engine.constrained.backend import (
    GrammarBackend,
    NoGrammarBackend,
    XGrammarBackend,
    check_grammar,
    create_grammar_backend,
    refuse_structured_output,
)
from rollout_engine.constrained.matcher import (
    Grammar,
    GrammarBatch,
    GrammarState,
    TokenMask,
    apply_token_bitmask,
)
from rollout_engine.constrained.pending import GrammarQueue
from rollout_engine.constrained.spec import Constraint, constraint_from_params, make_constraint

__all__ = ["Constraint", "Grammar", "GrammarBackend", "GrammarBatch", "GrammarQueue",
           "GrammarState", "NoGrammarBackend", "TokenMask", "XGrammarBackend",
           "apply_token_bitmask", "check_grammar", "constraint_from_params",
           "create_grammar_backend", "make_constraint", "refuse_structured_output"]
