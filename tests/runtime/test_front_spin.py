"""The front's spin (``OMNIFLOW_SPIN_US``): after a run goes out or a message comes in, the
front polls its workers' sockets without sleeping for a while, as long as remote work is in
flight; an idle or quiet front sleeps. It only changes when replies are read, never what the
calls answer (the scenario suite runs with it on, the default)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import omniflow as of
from omniflow import TransportError
from omniflow.transport import FAST_PATH_ENV
from omniflow.transport._fastpath import DEFAULT_SPIN_US, MAX_SPIN_US, SPIN_ENV, front_spin

from .test_fast_path import graphs


@pytest.mark.parametrize(
    ("fast", "spin", "want"),
    [
        ("1", None, DEFAULT_SPIN_US / 1e6),
        ("0", None, 0.0),
        ("1", "0", 0.0),
        ("1", " 2000 ", 0.002),
        ("0", "300", 0.0003),  # an explicit spin is read as given (a front off the fast path
        # does not use it: RemoteRoles spins only with the fast path on)
        ("1", str(MAX_SPIN_US), MAX_SPIN_US / 1e6),
    ],
)
def test_the_spin_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, fast: str, spin: str | None, want: float
) -> None:
    monkeypatch.setenv(FAST_PATH_ENV, fast)
    if spin is None:
        monkeypatch.delenv(SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(SPIN_ENV, spin)
    assert front_spin() == pytest.approx(want)


@pytest.mark.parametrize("bad", ["x", "-1", "1.5", str(MAX_SPIN_US + 1), "1e3"])
def test_a_spin_that_is_not_whole_microseconds_in_range_is_refused(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv(SPIN_ENV, bad)
    with pytest.raises(TransportError, match=rf"{SPIN_ENV}={bad!r}.*whole microseconds"):
        front_spin()


async def _until(what: str, ok: Callable[[], bool]) -> None:
    """Wait (loop turns, hang guard 30 s) until ``ok()``."""
    for _ in range(3000):
        if ok():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


@pytest.mark.slow
async def test_a_chain_spins_while_in_flight_and_stops_after(
    monkeypatch: pytest.MonkeyPatch, runtime: Callable[..., Any]
) -> None:
    monkeypatch.setenv(SPIN_ENV, "5000")
    g = graphs()["fp_chain"]
    async with of.Runtime(g) as local:
        want = [await local.run("fp_chain", {"x": x}) for x in range(10)]
    rt = await runtime(g, placement="process")
    assert rt.remote is not None and rt.remote.spin == pytest.approx(0.005)
    got = [await rt.run("fp_chain", {"x": x}) for x in range(10)]
    assert got == want
    assert rt.remote.spins > 0
    # nothing in flight: the spin ends at its next turn, and the front sleeps
    await _until("the spinner ended", lambda: rt.remote is not None and rt.remote._spinner is None)
    spins = rt.remote.spins
    await asyncio.sleep(0.05)
    assert rt.remote.spins == spins


@pytest.mark.slow
async def test_a_quiet_run_stops_the_spin_while_still_in_flight(
    monkeypatch: pytest.MonkeyPatch, runtime: Callable[..., Any]
) -> None:
    monkeypatch.setenv(SPIN_ENV, "1000")
    rt = await runtime(graphs()["fp_quiet"], placement="process")
    assert rt.remote is not None
    call = rt.call("fp_quiet", {"x": 1})
    await _until("the run is in flight", lambda: rt.remote is not None and bool(rt.remote._pending))
    # no message for longer than the spin: the front sleeps though the run is not done
    await _until("the spinner ended", lambda: rt.remote is not None and rt.remote._spinner is None)
    assert rt.remote._pending and not call.done
    await call.cancel()
    assert call.status == "cancelled"


@pytest.mark.slow
async def test_spin_zero_never_spins(
    monkeypatch: pytest.MonkeyPatch, runtime: Callable[..., Any]
) -> None:
    monkeypatch.setenv(SPIN_ENV, "0")
    rt = await runtime(graphs()["fp_chain"], placement="process")
    assert rt.remote is not None
    for x in range(5):
        await rt.run("fp_chain", {"x": x})
    assert rt.remote.spin == 0 and rt.remote.spins == 0 and rt.remote._spinner is None
