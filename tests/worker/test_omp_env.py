"""Workers' OpenMP threads spin briefly, then sleep, unless the user chose how they wait."""

from __future__ import annotations

import pytest

from evenflow.worker.omp_env import QUIET_WAIT, quiet_omp_waits


def test_quiet_waits_are_set_when_nothing_was_chosen() -> None:
    env = {"PATH": "/bin"}
    assert quiet_omp_waits(env) == QUIET_WAIT and env == {"PATH": "/bin", **QUIET_WAIT}
    # A short spin, not libgomp's 300,000 (which collapses beside a busy process) nor none (a
    # futex wake-up per region doubles a B=1 step), and no wait policy that would override it.
    assert 0 < int(env["GOMP_SPINCOUNT"]) < 300_000 and "OMP_WAIT_POLICY" not in env


@pytest.mark.parametrize("chosen", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"},
                                    {"KMP_BLOCKTIME": "200"}])
def test_a_users_choice_is_left_alone(chosen: dict[str, str]) -> None:
    env = dict(chosen)
    assert quiet_omp_waits(env) == {} and env == chosen
