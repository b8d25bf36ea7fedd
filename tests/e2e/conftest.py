"""Fixtures of the end-to-end tests: the tiny job's trained phases (the embedded Ray,
``ray_session``, is tests/conftest.py's)."""

from __future__ import annotations

import pytest

from tests.support.running_job import train_phases


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """Finished teacher and warm-up runs, shared by every job below (copied in)."""
    return train_phases(tmp_path_factory.mktemp("phases"))
