"""In-process CLI calls must not inherit a launcher environment."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process main() calls must not think they run under torchrun."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
