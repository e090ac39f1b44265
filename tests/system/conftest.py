"""System tests: the real entry points as separate OS processes, wired together.

Every test here carries the `system` marker, so `pytest -m "not system"` runs the
in-process suite alone. The stack and process fixtures are in tests/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SYSTEM_DIR = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(SYSTEM_DIR):
            item.add_marker(pytest.mark.system)
