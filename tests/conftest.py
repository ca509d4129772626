"""Shared fixtures for the whole test suite.

- Every ``async def`` test runs twice: on stock asyncio (in debug mode, which among other
  things raises when a non-thread-safe loop method is called from another thread) and on
  uvloop. This overrides pytest-asyncio's ``event_loop_policy`` fixture; only coroutine tests
  are parametrized, so synchronous tests run once.
- No test may leave an ``overlap-`` stream thread alive: the backend's worker threads must be
  joined by ``close()``. A leaked thread fails the test (as a teardown error).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
import time
from pathlib import Path

import pytest
import pytest_asyncio

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
    uvloop = None

# The benchmark suites (benchmarks/suites.py) and the toy model (examples/toy.py) are shared
# with the tests; they live beside the packages, not in them.
_ROOT = Path(__file__).resolve().parents[1]
for _dir in ("benchmarks", "examples"):
    if str(_ROOT / _dir) not in sys.path:
        sys.path.insert(0, str(_ROOT / _dir))

_ASYNCIO_POLICY = asyncio.DefaultEventLoopPolicy()
_LOOP_POLICIES = [
    pytest.param(_ASYNCIO_POLICY, id="asyncio"),
    pytest.param(uvloop.EventLoopPolicy(), id="uvloop")
    if uvloop is not None
    else pytest.param(None, id="uvloop", marks=pytest.mark.skip(reason="uvloop not installed")),
]

# A stream thread that outlives its test this long after the test ended counts as leaked.
THREAD_GRACE_S = 2.0


def pytest_configure(config: pytest.Config) -> None:
    # pytest-asyncio >= 1.x deprecates overriding ``event_loop_policy`` in favour of its
    # ``pytest_asyncio_loop_factories`` hook; the override still works there and is the only
    # mechanism in the 0.23 series that pyproject.toml allows, so keep it and stay quiet.
    config.addinivalue_line(
        "filterwarnings", "ignore:Overriding the \"event_loop_policy\" fixture is deprecated"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if inspect.iscoroutinefunction(metafunc.function) and (
        "event_loop_policy" in metafunc.fixturenames
    ):
        # Function-scoped parameters keep the collection order (no regrouping by policy).
        metafunc.parametrize("event_loop_policy", _LOOP_POLICIES, indirect=True,
                             scope="function")


@pytest.fixture(scope="session")
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Stock asyncio or uvloop for coroutine tests (see :func:`pytest_generate_tests`)."""
    return getattr(request, "param", _ASYNCIO_POLICY)


@pytest_asyncio.fixture
async def _debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    return loop


@pytest.fixture(autouse=True)
def _asyncio_debug_mode(request: pytest.FixtureRequest) -> None:
    """Turn on debug mode on the loop that runs a coroutine test (sync tests get no loop)."""
    if pytest_asyncio.is_async_test(request.node):
        request.getfixturevalue("_debug_loop")


def _leaked(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith("overlap-") and t not in before and t.is_alive()]


@pytest.fixture(autouse=True)
def _no_leaked_stream_threads():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + THREAD_GRACE_S
    leaked = _leaked(before)
    while leaked and time.monotonic() < deadline:
        for t in leaked:
            t.join(0.02)
        leaked = _leaked(before)
    if leaked:
        pytest.fail(f"stream threads still alive {THREAD_GRACE_S:g} s after the test: "
                    f"{sorted(t.name for t in leaked)}", pytrace=False)


@pytest.fixture
def pair():
    """Two ranks' host links in one process (``HostLinks`` 0 and 1, joined by a socket
    pair), each read by its own progress engine (as two processes' are: a test may hold one
    rank's engine without stopping the other's). Links and engines are closed after the
    test."""
    import socket

    from overlap.backends.job.engine import Engine
    from overlap.backends.job.host_links import HostLinks

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    engines = Engine("overlap-engine-r0"), Engine("overlap-engine-r1")
    links = HostLinks(0, {1: a}, engines[0]), HostLinks(1, {0: b}, engines[1])
    yield links
    for lk in links:
        lk.close()
    for engine in engines:
        engine.close()
