import pytest

# Inactive unless ASYNC_PP_EXACTNESS_REPORT names a file (see the module).
pytest_plugins = ["tests.fixtures.exactness_report"]


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch):
    monkeypatch.setenv("PL_DISABLE_FORK", "1")
