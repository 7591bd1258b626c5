"""The tier lock's own rules (gateway/routing/tier_lock.py): a conversation is its opening, per tenant; only a
turn inside a tool loop continues one; locks expire, are bounded, and move only where one is held."""

from __future__ import annotations

import time

from gateway.routing.tier_lock import TierLocks, continues, opening_key

OPENING = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Oslo?"}]
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1"}]}


def test_a_conversation_is_its_opening_per_tenant() -> None:
    later = [*OPENING, CALL, {"role": "tool", "content": "sunny"}, {"role": "user", "content": "And Bergen?"}]
    assert opening_key(1, OPENING) == opening_key(1, later)
    assert opening_key(1, OPENING) != opening_key(2, OPENING)  # another tenant's loop is another lock
    assert opening_key(1, OPENING) != opening_key(1, [OPENING[0], {"role": "user", "content": "Weather in Rome?"}])


def test_only_a_turn_inside_a_tool_loop_continues_one() -> None:
    assert not continues(OPENING)
    assert not continues([*OPENING, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}])
    assert continues([*OPENING, CALL])
    assert continues([*OPENING, {"role": "tool", "content": "sunny"}])


def test_locks_expire_are_bounded_and_move_only_where_held() -> None:
    locks = TierLocks(ttl_s=0.2, max_locks=3)
    locks.hold("a", "small")
    assert locks.get("a") == "small"
    locks.move("b", "large")  # nothing held for b: an escalation does not create a lock
    assert locks.get("b") is None
    locks.move("a", "large")
    assert locks.get("a") == "large"
    time.sleep(0.3)
    assert locks.get("a") is None and len(locks) == 0
    for key in "wxyz":
        locks.hold(key, "small")
    assert len(locks) == 3 and locks.get("w") is None and locks.get("z") == "small"  # the oldest went first
