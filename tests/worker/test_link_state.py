"""A headless worker's step link: lost only when it stays down, not when ZMQ reconnects it."""

from __future__ import annotations

from evenflow.worker.process import LINK_GRACE_S, LinkState


def test_a_link_that_came_back_is_not_lost() -> None:
    link = LinkState()
    link.note(False, 0.0)  # a disconnect before any handshake: still connecting
    assert not link.lost(100.0)
    link.note(True, 1.0)
    link.note(False, 2.0)  # dropped during start-up, read late ...
    link.note(True, 2.0)  # ... after ZMQ had reconnected it
    assert not link.lost(2.0 + 10 * LINK_GRACE_S)


def test_a_link_that_stays_down_is_lost_after_the_grace() -> None:
    link = LinkState()
    link.note(True, 0.0)
    link.note(False, 1.0)
    assert not link.lost(1.0 + LINK_GRACE_S / 2)
    link.note(False, 2.0)  # a second disconnect does not restart the clock
    assert link.lost(1.0 + LINK_GRACE_S * 1.01)
