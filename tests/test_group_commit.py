"""Group commit (``engine/_group_commit.py``): what is handed in while one batch is written goes in the
next, each caller gets its batch's result or error, and a cancelled caller takes its item out of a batch
not begun (handing the batch's write to another caller) or leaves it in a batch under way.

The write is the edge, so it is a recording function here; the clock is Trio's autojump clock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engine._group_commit import GroupCommit


class Writes:
    """A write that records each batch and takes ``seconds`` (autojump clock) to write it."""

    def __init__(self, seconds: float = 1.0, fail_with: Exception | None = None) -> None:
        self.seconds = seconds
        self.fail_with = fail_with
        self.batches: list[list[str]] = []

    async def __call__(self, items: list[str]) -> int:
        self.batches.append(list(items))
        await trio.sleep(self.seconds)
        if self.fail_with is not None:
            raise self.fail_with
        return len(self.batches)


async def test_what_comes_during_a_write_is_written_together_in_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    writes = Writes()
    commits = GroupCommit(writes)
    got: dict[str, int] = {}

    async def submit(item: str) -> None:
        got[item] = await commits.submit(item)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submit, "first")
        await trio.sleep(0.1)  # "first" is being written
        for i in range(9):
            nursery.start_soon(submit, f"later-{i}")
    assert [sorted(batch) for batch in writes.batches] == [["first"], [f"later-{i}" for i in range(9)]]
    assert got == {"first": 1, **{f"later-{i}": 2 for i in range(9)}}  # each got its own batch's result
    assert commits.batches == 2 and "idle" in repr(commits)


async def test_a_writes_error_is_raised_to_each_caller_of_its_batch_and_the_next_batch_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    writes = Writes(fail_with=OSError(28, "No space left on device (test)"))
    commits = GroupCommit(writes)
    errors: list[BaseException] = []

    async def submit(item: str) -> None:
        try:
            await commits.submit(item)
        except OSError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for item in "abc":
            nursery.start_soon(submit, item)
    assert len(errors) == 3 and [sorted(batch) for batch in writes.batches] == [["a", "b", "c"]]
    writes.fail_with = None
    assert await commits.submit("d") == 2


async def test_a_caller_cancelled_before_its_batch_is_written_takes_its_item_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    writes = Writes()
    commits = GroupCommit(writes)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(commits.submit, "first")
        await trio.sleep(0.1)
        with trio.move_on_after(0.5):  # "first" is written until 1.0: this batch does not begin by then
            await commits.submit("given-up")
        await commits.submit("kept")
    assert writes.batches == [["first"], ["kept"]]


async def test_a_batch_whose_writer_is_cancelled_is_written_by_another_caller_of_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    writes = Writes()
    commits = GroupCommit(writes)
    results: list[int] = []

    async def kept(item: str) -> None:
        results.append(await commits.submit(item))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(commits.submit, "first")
        await trio.sleep(0.1)
        leader = trio.CancelScope()

        async def lead() -> None:
            with leader:
                await commits.submit("leader")  # the first of the second batch: it would write it

        nursery.start_soon(lead)
        await trio.sleep(0.1)
        nursery.start_soon(kept, "joined-1")
        nursery.start_soon(kept, "joined-2")
        await trio.sleep(0.1)
        leader.cancel()
    assert leader.cancelled_caught
    assert [sorted(batch) for batch in writes.batches] == [["first"], ["joined-1", "joined-2"]]
    assert results == [2, 2]


async def test_a_caller_cancelled_while_its_batch_is_written_leaves_its_item_written(
    autojump_clock: trio.testing.MockClock,
) -> None:
    writes = Writes()
    commits = GroupCommit(writes)
    returned = None
    with trio.move_on_after(0.5) as scope:
        returned = await commits.submit("written")  # the write takes 1.0: it goes on to its end
        await trio.lowlevel.checkpoint()  # where the cancellation is delivered, as after a worker thread
    assert scope.cancelled_caught and returned == 1
    assert writes.batches == [["written"]] and trio.current_time() >= 1.0


@pytest.mark.parametrize("count", [1, 5])
async def test_equal_items_of_two_callers_are_each_their_own(
    autojump_clock: trio.testing.MockClock, count: int
) -> None:
    writes = Writes()
    commits = GroupCommit(writes)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(commits.submit, "first")
        await trio.sleep(0.1)
        for _ in range(count):
            nursery.start_soon(commits.submit, "same")
        with trio.move_on_after(0.2):
            await commits.submit("same")  # taken out: one of the equal items, its own
    assert writes.batches == [["first"], ["same"] * count]
