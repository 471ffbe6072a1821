"""Switching speculation off for a request whose proposals keep failing.

A verify row costs the target ``1 + k`` positions for ``k`` proposals; when few of them are
accepted the plain decode step (one position, the decode kernel) is the cheaper way to the same
tokens. Each request keeps a running estimate of proposals accepted per verify (an exponential
moving average, weight ``ALPHA`` on the newest verify, starting optimistic at ``START``). While
it is below ``min_accept`` the request decodes without proposals, and every ``probe_interval``
such steps it proposes once more (a re-probe: the text may have turned repetitive, a draft may
have been refit), so a request that starts copying is switched back on::

    accepted per verify:  0    0    |  off x probe_interval  | probe: 3 |  on ...
    estimate (0.5 gate):  0.5  0.25 |                        | 1.625    |

The switch changes which forward computes a token, never the token: outputs are the same either
way. The estimate is per request (its own text), so what one request does never switches another
off; a batch whose every request is off runs the plain decode step. Counted as
``spec_off_low_accept_rows`` (request-steps) and ``spec_off_low_accept_steps`` (whole batches),
and per request as ``meta_info.spec_off_low_accept_ct``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALPHA", "AcceptanceGate", "START"]

ALPHA = 0.5          # weight of the newest verify in the running estimate
START = 1.0          # the estimate before a request's first verify (two misses turn it off)


@dataclass
class _Estimate:
    accepted: float = START      # proposals accepted per verify, running
    off_steps: int = 0           # plain steps since the estimate fell below the gate


class AcceptanceGate:
    """Per-request running acceptance, keyed by arrival number (as the n-gram indexes)."""

    def __init__(self, min_accept: float, probe_interval: int) -> None:
        if min_accept < 0 or probe_interval < 1:
            raise ValueError(f"acceptance gate: need min_accept >= 0 ({min_accept}) and "
                             f"probe_interval >= 1 ({probe_interval})")
        self.min_accept = min_accept
        self.probe_interval = probe_interval
        self.estimates: dict[int, _Estimate] = {}

    def allows(self, key: int) -> bool:
        """Whether the request may propose this step (call once per decode step it is in)."""
        est = self.estimates.get(key)
        if est is None or est.accepted >= self.min_accept:
            return True
        est.off_steps += 1
        if est.off_steps > self.probe_interval:     # re-probe
            est.off_steps = 0
            return True
        return False

    def record(self, key: int, drafted: int, accepted: int) -> None:
        """One verify of the request's ``drafted`` proposals, ``accepted`` of them confirmed."""
        if drafted <= 0:
            return
        est = self.estimates.setdefault(key, _Estimate())
        est.accepted = (1 - ALPHA) * est.accepted + ALPHA * accepted

    def estimate(self, key: int) -> float:
        est = self.estimates.get(key)
        return START if est is None else est.accepted

    def forget(self, live: set[int]) -> None:
        for key in [k for k in self.estimates if k not in live]:
            del self.estimates[key]
