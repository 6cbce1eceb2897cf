"""The head's one admission gate: a place within the queue timeout, a lane within the same deadline, and
nothing let in once the daemon drains."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from skippyd.head.admission import AdmissionGate
from skippyd.head.errors import Draining, QueueTimeout
from skippyd.head.lanes import LanePool, NoLaneAvailable


async def test_one_queue_timeout_covers_the_place_and_the_lane(autojump_clock):
    """A generation waits for a place at most the queue timeout, and for a lane after it only what is left of
    the same deadline: the waits never add up to two timeouts."""
    gate = AdmissionGate(1, timeout=3.0)
    started = trio.current_time()
    deadline = await gate.enter()
    assert deadline == started + 3.0 and trio.current_time() == started  # a free place: no wait
    with pytest.raises(QueueTimeout, match=r"no free session slot within 3 s \(all 1 busy\)"):
        await gate.enter()
    assert trio.current_time() == started + 3.0
    gate.leave()
    await trio.sleep(1.0)
    deadline = await gate.enter()

    class Link:
        def looks_alive(self) -> bool:
            return True

    async def open_link() -> Link:
        return Link()

    pool = LanePool("127.0.0.1", 9, hello=None, capacity=1)
    pool._open = open_link
    await pool.checkout(deadline)  # a free lane is taken whatever is left
    await trio.sleep(2.0)  # the other lane's holder keeps it; 1 s of the admission's deadline is left
    with pytest.raises(NoLaneAvailable):
        await pool.checkout(deadline)
    assert trio.current_time() == deadline


async def test_a_draining_gate_refuses_newcomers_and_those_waiting_at_once(autojump_clock, nursery):
    gate = AdmissionGate(1, timeout=30.0)
    await gate.enter()
    refused: list[BaseException] = []

    async def wait_for_a_place() -> None:
        try:
            await gate.enter()
        except Draining as exc:
            refused.append(exc)

    nursery.start_soon(wait_for_a_place)
    await trio.sleep(1.0)
    started = trio.current_time()
    gate.close("the daemon is draining: no new generations")
    await trio.sleep(0)
    await trio.testing.wait_all_tasks_blocked()
    assert len(refused) == 1 and trio.current_time() == started  # not after the queue timeout
    assert refused[0].retryable and refused[0].status == 503
    with pytest.raises(Draining, match="draining"):
        await gate.enter()
    gate.leave()  # the generation that was in ends as usual
    with pytest.raises(Draining):
        await gate.enter()
