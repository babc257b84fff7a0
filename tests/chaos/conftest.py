import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: runs `python -m bench chaos` at CI size (minutes)")
