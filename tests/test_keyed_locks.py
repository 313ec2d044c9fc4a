"""One lock per key, dropped when unused: mutual exclusion per key, nothing kept for keys seen once."""

from __future__ import annotations

import trio
import trio.testing

from engine import SpawnSpec, Supervisor
from engine._keyed_locks import KeyedLocks


async def test_keyed_locks_exclude_per_key_and_drop_unused_locks() -> None:
    locks = KeyedLocks()
    inside: list[str] = []
    order: list[str] = []

    async def hold(key: str, name: str) -> None:
        async with locks.hold(key):
            inside.append(key)
            assert inside.count(key) == 1  # never two holders of one key
            order.append(name)
            await trio.sleep(0.01)
            inside.remove(key)

    async with trio.open_nursery() as nursery:
        for n in range(5):
            nursery.start_soon(hold, "a", f"a{n}")
            nursery.start_soon(hold, "b", f"b{n}")
        await trio.testing.wait_all_tasks_blocked()
        assert len(locks) == 2
    assert sorted(order) == sorted([f"a{n}" for n in range(5)] + [f"b{n}" for n in range(5)])
    assert len(locks) == 0


async def test_keyed_locks_drop_the_lock_of_a_cancelled_waiter() -> None:
    locks = KeyedLocks()
    release = trio.Event()

    async def holder(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with locks.hold("k"):
            task_status.started()
            await release.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(holder)
        with trio.move_on_after(0.01):
            async with locks.hold("k"):
                raise AssertionError("the lock is held by the other task")
        assert len(locks) == 1  # the holder's
        release.set()
    assert len(locks) == 0


async def test_supervisor_keeps_no_lock_for_scopes_it_is_done_with(supervisor: Supervisor) -> None:
    for n in range(50):
        run = await supervisor.spawn(
            SpawnSpec(argv=("true",), scope_key=f"scope-{n}", replace_existing_scope=True)
        )
        await run.wait()
        await supervisor.cancel_scope(f"scope-{n}")
    assert len(supervisor._locks) == 0
