"""What every test process shares: the garbage collector paced as the command line paces
it (``hetplan.collector``: the searches under test build the same memo tables), and the
tests marked ``slow`` collected first."""

from __future__ import annotations

import pytest

from hetplan.collector import pace_collector

pace_collector()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Moves the tests marked ``slow`` (15 s and more on two cores) to the front, keeping
    the order within each part. pytest-xdist hands tests out in collection order, so a
    long test collected last (the README's tour, 2 minutes, among the root's files) would
    keep one worker busy after the other has run out of work; first, it runs beside the
    short ones."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
