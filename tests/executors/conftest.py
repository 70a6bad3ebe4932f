"""Fixtures of the executor tests: each route of the per-job host work (`executors.jobcode`).

A module that runs on both routes says `pytestmark = pytest.mark.usefixtures("route")`: its
tests then run once per route, and every executor they make takes that route by default (the
fixture sets `KVFERRY_NO_NATIVE` as a user would). The Python route always runs; the compiled
one where its module is built, else it is skipped, visibly.
"""

from __future__ import annotations

import pytest

from kvferry.executors.jobcode import NO_NATIVE_ENV, JobCode, job_code, native_available

ROUTES = [
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not native_available(),
            reason="the compiled module kvferry.executors._native is not built here",
        ),
    ),
    "python",
]


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Return the route of this run of the test, the default of the executors it makes."""
    name = str(request.param)
    if name == "python":
        monkeypatch.setenv(NO_NATIVE_ENV, "1")
    else:
        monkeypatch.delenv(NO_NATIVE_ENV, raising=False)
    return name


@pytest.fixture
def jobs(route: str) -> JobCode:
    """Return the module of this run's route."""
    return job_code(route)
