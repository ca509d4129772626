"""The CPU backend keeps the host memory it frees (``overlap.backends.devices.host_memory``):
a step whose peak moves is not page-faulted back in at every step; the user's own glibc
settings stand. Each case runs in a fresh interpreter: the setting is the process's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="the setting is glibc's")

# A block of 8 MiB freed moves glibc's default thresholds up to it; then each round keeps
# 64 blocks of 1 MiB and frees them all (a split backward's kept gradients, in small). The
# page faults of the rounds after the first, per round.
STEPS = """
import resource, sys
import numpy as np
{make}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
big = np.ones(1 << 20); del big
def round_():
    kept = [np.ones(1 << 17) for _ in range(64)]
    del kept
round_()
f0 = faults()
for _ in range(5):
    round_()
print((faults() - f0) / 5)
"""
RUNTIME = ("from overlap import Runtime\nfrom scheduler import Cluster\n"
           "Runtime(Cluster(1, 2, nic_gbps=100.0), backend='cpu').close()")
PAGES = (64 << 20) // 4096  # one round's pages


def faults_per_round(make: str, env: dict[str, str] | None = None) -> float:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ["PYTHONPATH"] = str(ROOT)
    environ.update(env or {})
    out = subprocess.run([sys.executable, "-c", STEPS.format(make=make)], env=environ,
                         capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.split()[-1])


def test_a_cpu_runtime_keeps_freed_host_memory() -> None:
    without = faults_per_round("")
    kept = faults_per_round(RUNTIME)
    assert without > PAGES / 2  # (glibc's default: the freed top is handed back each round)
    assert kept < PAGES / 100


def test_the_users_own_glibc_settings_stand() -> None:
    # Trimming at 128 KiB, as the user asked: every round's top is handed back again.
    assert faults_per_round(RUNTIME, {"MALLOC_TRIM_THRESHOLD_": "131072"}) > PAGES / 2


def test_where_malloc_is_not_glibcs_nothing_is_set_and_the_runtime_runs() -> None:
    # (musl, macOS: no gnu_get_libc_version among the process's symbols.)
    not_glibc = ("import ctypes\n"
                 "class NotGlibc:\n"
                 "    def __init__(self, *args, **kwargs): pass\n"
                 "    def __getattr__(self, name): raise AttributeError(name)\n"
                 "ctypes.CDLL = NotGlibc\n"
                 "from overlap.backends.devices.host_memory import keep_freed_host_memory\n"
                 "assert keep_freed_host_memory() is False\n" + RUNTIME)
    assert faults_per_round(not_glibc) > PAGES / 2
