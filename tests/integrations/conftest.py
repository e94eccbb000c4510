"""Shared fixtures of the Megatron-Core integration tests."""

import pytest


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI tests run in this process: a torchrun environment around pytest must not make
    them look launched."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
