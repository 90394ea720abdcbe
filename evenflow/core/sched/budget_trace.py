"""A per-step trace of the adaptive budget's hand-out, for finding where a step's room went.

Off unless ``$EVENFLOW_BUDGET_TRACE`` names a file: then every planned step that carried decodes
appends one JSON line when its time arrives: the target and the aim it was planned to, what the
decodes alone were predicted to take, the allowance and which rule bound it, the prompt tokens
that used it, and the predicted and measured step, and the wall clock.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import IO

TRACE_ENV = "EVENFLOW_BUDGET_TRACE"


@dataclass
class PlannedStep:
    """What the controller decided for one step, and (filled in later) what it cost."""

    step_id: int
    target_ms: float
    aim_ms: float
    decodes: int
    base_ms: float  # the decodes alone, predicted
    allowance: int
    bound_by: str  # aim, share, measured, floor, trust, room, warm-up; a layer group: layers:<rule> (probe, target too)
    prefill_tokens: int = 0  # what the step's prompt chunks took of the allowance
    predicted_ms: float = 0.0
    measured_ms: float = 0.0
    unix_s: float = 0.0  # wall clock when its time arrived: ties the step to a client's records
    contended: bool = False  # a core was busy elsewhere: the controller learnt nothing from it


class BudgetTrace:
    """Appends ``PlannedStep`` lines to the file ``$EVENFLOW_BUDGET_TRACE`` names (None: no trace)."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file

    @classmethod
    def from_env(cls) -> BudgetTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(open(path, "a", buffering=1)) if path else None  # line-buffered: a killed engine keeps its trace

    def write(self, step: PlannedStep) -> None:
        step.unix_s = time.time()
        self.file.write(json.dumps(asdict(step)) + "\n")
