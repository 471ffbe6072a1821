"""What a `RolloutFleet` call answers: one `EngineResult` per engine in a `FleetReport`, and
the errors that carry one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["EngineResult", "FleetError", "FleetRefitError", "FleetReport"]


@dataclass(frozen=True)
class EngineResult:
    """One engine's part of a fleet call: `answer` on success, else `error`; `version` is the
    weight version it reported afterwards (None when it did not answer)."""

    index: int
    ok: bool
    seconds: float
    answer: Any = None
    error: Optional[str] = None
    version: Optional[str] = None
    quarantined: bool = False


@dataclass(frozen=True)
class FleetReport:
    """A fleet call: wall `seconds` for all engines, `bytes` sent once by the trainer (refits),
    and one `EngineResult` per engine, in the fleet's order. In a successful refit an engine's
    `seconds` run from the start of the push (after any group formation) to its last update
    call's answer: how long that engine took to receive and apply the new weights."""

    action: str
    seconds: float
    engines: list[EngineResult]
    bytes: int = 0
    version: Optional[str] = None
    transport: Optional[str] = None

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.engines)

    @property
    def versions(self) -> dict[int, Optional[str]]:
        """Engine index -> the weight version it reported (None: unreachable)."""
        return {e.index: e.version for e in self.engines}


class FleetError(RuntimeError):
    """A fleet call failed on some engines; `report` says which and why."""

    def __init__(self, message: str, report: FleetReport) -> None:
        super().__init__(message)
        self.report = report


class FleetRefitError(FleetError):
    """A refit failed on some engines; `report.versions` says which engine holds which weight
    version, and `EngineResult.quarantined` which were made to refuse generation."""
