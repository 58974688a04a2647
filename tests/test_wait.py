"""The bounded wait (``torchrl_ext._wait``): what it returns, when it looks, how long it pauses.
A fake clock and sleep stand in for time; no test measures elapsed time."""

from __future__ import annotations

import math
import os
import select
import threading
import time

import pytest

from torchrl_ext._wait import FIRST, SLICE, Late, on, wait_for

START = 100.0


class FakeTime:
    """A clock that moves only when ``sleep`` is called; records each pause and each look."""

    def __init__(self) -> None:
        self.now = START
        self.pauses: list[float] = []
        self.looks: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds

    def ready_after(self, looks: int, value: object = "ready") -> object:
        """A ``ready`` check that is false for its first ``looks - 1`` calls."""

        def ready() -> object:
            self.looks.append(self.now)
            return value if len(self.looks) >= looks else None

        return ready


@pytest.mark.compat
def test_the_first_true_value_is_returned() -> None:
    fake = FakeTime()
    got = wait_for(fake.ready_after(3, {"a": 1}), START + 10, "never", sleep=fake.sleep, clock=fake.clock)
    assert got == {"a": 1}
    assert len(fake.looks) == 3


@pytest.mark.compat
def test_a_value_ready_at_once_needs_no_pause() -> None:
    fake = FakeTime()
    assert wait_for(lambda: 7, START, "never", sleep=fake.sleep, clock=fake.clock) == 7
    assert fake.pauses == []


@pytest.mark.compat
def test_at_the_deadline_it_returns_late_after_one_last_look() -> None:
    fake = FakeTime()
    late = wait_for(fake.ready_after(math.inf), START + 1.0, "not ready within 1 s", **_fake(fake))
    assert isinstance(late, Late)
    assert not late
    assert late.reason == "not ready within 1 s"
    assert late.waited == pytest.approx(1.0)
    assert fake.looks[-1] >= START + 1.0 > fake.looks[-2]


@pytest.mark.compat
def test_the_last_look_at_the_deadline_can_still_succeed() -> None:
    fake = FakeTime()
    deadline = START + 1.0

    def ready() -> str | None:
        fake.looks.append(fake.now)
        return "ready" if fake.now >= deadline else None

    assert wait_for(ready, deadline, "late", **_fake(fake)) == "ready"
    assert fake.looks[-1] == deadline > fake.looks[-2]


@pytest.mark.compat
def test_a_deadline_already_passed_gets_one_look() -> None:
    fake = FakeTime()
    late = wait_for(fake.ready_after(math.inf), START - 5, "gone", **_fake(fake))
    assert isinstance(late, Late)
    assert len(fake.looks) == 1
    assert fake.pauses == []


@pytest.mark.compat
def test_it_never_pauses_past_the_deadline() -> None:
    fake = FakeTime()
    deadline = START + 0.137
    looks = 0

    def sleep(seconds: float) -> None:
        assert fake.now + seconds <= deadline
        fake.sleep(seconds)

    def ready() -> None:
        nonlocal looks
        looks += 1

    assert not wait_for(ready, deadline, "late", sleep=sleep, clock=fake.clock)
    assert fake.now == deadline
    assert looks == len(fake.pauses) + 1


@pytest.mark.compat
def test_the_pause_doubles_from_the_first_up_to_the_slice() -> None:
    fake = FakeTime()
    wait_for(fake.ready_after(15), math.inf, "never", **_fake(fake))
    assert fake.pauses[0] == FIRST
    expected = [FIRST]
    while len(expected) < len(fake.pauses):
        expected.append(min(2 * expected[-1], SLICE))
    assert fake.pauses == expected
    assert fake.pauses[-3:] == [SLICE] * 3


@pytest.mark.compat
def test_a_given_slice_and_first_pause_are_kept() -> None:
    fake = FakeTime()
    wait_for(fake.ready_after(6), math.inf, "never", first=0.001, slice=0.005, **_fake(fake))
    assert fake.pauses == [0.001, 0.002, 0.004, 0.005, 0.005]


@pytest.mark.compat
def test_an_exception_of_the_check_propagates() -> None:
    def ready() -> bool:
        raise ProcessLookupError("gone")

    with pytest.raises(ProcessLookupError):
        wait_for(ready, math.inf, "never")


@pytest.mark.compat
def test_a_waitable_ends_the_pause_early() -> None:
    """Pauses of a minute: a pipe written from a thread once the first pause has begun ends
    that pause (the wait reports the pipe ready, not a timeout), and the next look succeeds."""
    read_end, write_end = os.pipe()
    pausing = threading.Event()
    writer = threading.Thread(target=lambda: (pausing.wait(), os.write(write_end, b"x")))
    writer.start()
    looks = 0
    woken_by: list[object] = []
    pause_on_pipe = on([read_end])

    def sleep(seconds: float) -> None:
        pausing.set()
        woken_by.append(pause_on_pipe(seconds))

    def ready() -> bool:
        nonlocal looks
        looks += 1
        return bool(select.select([read_end], [], [], 0)[0])

    try:
        got = wait_for(ready, time.monotonic() + 600, "no byte", sleep=sleep, first=60, slice=60)
        assert got is True
        assert looks == 2
        assert woken_by == [[read_end]]
    finally:
        pausing.set()
        writer.join()
        os.close(read_end)
        os.close(write_end)


@pytest.mark.compat
def test_a_waitable_list_updated_in_place_is_followed() -> None:
    read_end, write_end = os.pipe()
    other_r, other_w = os.pipe()
    waitables = [read_end]
    sleep = on(waitables)
    try:
        os.write(other_w, b"x")
        waitables[:] = [other_r]
        assert sleep(60) == [other_r]
    finally:
        for fd in (read_end, write_end, other_r, other_w):
            os.close(fd)


def _fake(fake: FakeTime) -> dict[str, object]:
    return {"sleep": fake.sleep, "clock": fake.clock}
