"""Fixtures shared by every test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# Child processes (subprocess tests, services) inherit this: the test machine
# has few cores shared with other work.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _single_torch_thread() -> Iterator[None]:
    """One intra-op thread for torch, if a collected test module imported it.

    Looks torch up in sys.modules instead of importing it, so the torch-free
    tests stay torch-free (collection has imported every test module by now).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    yield
