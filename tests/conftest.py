import pytest


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch):
    monkeypatch.setenv("PL_DISABLE_FORK", "1")
