"""The engine skeleton: configuration, the state-dir lock, and shutdown."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine import EngineConfig, EngineLockedError, SpawnSpec, open_engine

from .children import SESSION, mark, pgrep, wait_until


async def test_open_engine_creates_private_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with open_engine(EngineConfig(state_dir=str(state), grace_seconds=0.3)) as engine:
        assert engine.state_dir == str(state)
        assert engine.config.grace_seconds == 0.3
        assert engine.supervisor.grace_seconds == 0.3
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert (state / "lock").exists()


async def test_open_engine_second_engine_on_same_state_dir_is_locked_out(tmp_path: Path) -> None:
    config = EngineConfig(state_dir=str(tmp_path), grace_seconds=0.3)
    async with open_engine(config):
        with pytest.raises(EngineLockedError, match="another engine holds"):
            async with open_engine(config):
                pass
    async with open_engine(config):  # released on exit
        pass


async def test_open_engine_exit_reaps_children_and_lets_errors_through(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError):
        async with open_engine(EngineConfig(state_dir=str(tmp_path), grace_seconds=0.3)) as engine:
            await engine.supervisor.spawn(SpawnSpec(argv=("bash", "-c", f"sleep {mark('328.1')} & wait")))
            await wait_until(lambda: bool(pgrep(rf"^sleep 328\.1{SESSION}")))
            1 / 0  # noqa: B018  # the error under test
    assert not pgrep(rf"sleep 328\.1{SESSION}")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("grace_seconds", -1.0),
        ("grace_seconds", 3601.0),  # at most an hour: nothing outlives a longer one in practice
        ("kill_wait_seconds", float("inf")),
        ("max_processes", 0),
        ("max_processes_per_project", True),
        ("log_cap_bytes", -5),
        ("exit_watch_shell", ()),
        ("exit_watch_shell", "bash -lc"),
    ],
)
def test_engine_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises((ValueError, TypeError), match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]  # deliberately wrong


def test_engine_config_default_state_dir_is_platform_state_dir() -> None:
    assert EngineConfig().resolved_state_dir().endswith("gadget-engine")


def test_owner_lost_seconds_must_outlast_a_heartbeat() -> None:
    with pytest.raises(ValueError, match="owner_lost_seconds must be more than 5 s"):
        EngineConfig(owner_lost_seconds=5.0)
    assert EngineConfig(owner_lost_seconds=8.0).owner_lost_seconds == 8.0


def test_a_runs_grace_is_bounded_as_the_engines() -> None:
    with pytest.raises(ValueError, match="grace_seconds must be a number of seconds from 0 to 3600"):
        SpawnSpec(argv=("true",), grace_seconds=3601.0)
    assert SpawnSpec(argv=("true",), grace_seconds=None).grace_seconds is None
