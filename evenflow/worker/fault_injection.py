"""TEST-ONLY fault injection: make a worker's forward raise after N steps.

Set ``EVENFLOW_TEST_FAIL_FORWARD_AFTER_STEPS=N`` in the engine-core's environment (workers inherit
it) to make every rank raise ``InjectedFault`` on its step N+1 instead of running the model.
Tests and ``scripts/chaos.py`` use it to prove that a failing forward ends every request with an
error naming the cause and stops the engine-core with a non-zero code. Never set it in production;
a worker that has it set says so in its log at start-up.
"""

from __future__ import annotations

import logging
import os

ENV = "EVENFLOW_TEST_FAIL_FORWARD_AFTER_STEPS"
log = logging.getLogger("evenflow.worker.fault_injection")


class InjectedFault(RuntimeError):
    """The test-only fault: raised in place of a forward pass."""


class FaultInjector:
    """Counts steps; raises once the count passes the limit from ``ENV`` (no-op when unset)."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        text = (os.environ if environ is None else environ).get(ENV, "")
        self.fail_after = int(text) if text.strip() else None
        self.steps = 0
        if self.fail_after is not None:
            log.warning("TEST-ONLY fault injection is on: the forward will raise after %d steps (%s)",
                        self.fail_after, ENV)

    def before_step(self) -> None:
        if self.fail_after is None:
            return
        self.steps += 1
        if self.steps > self.fail_after:
            raise InjectedFault(f"injected test fault: forward raised after {self.fail_after} steps ({ENV})")
