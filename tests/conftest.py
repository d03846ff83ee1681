"""Test set-up: 8 fake CPU devices for sharding tests, set before JAX is imported anywhere."""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (still run in CI)")


def _mappings() -> int:
    """Memory mappings this process holds (Linux; -1 elsewhere): see the cache clearing below."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return -1


def pytest_runtest_logreport(report):
    """``COMPRL_TEST_TIMES=<file>``: append each test's set-up / call / tear-down time and the process's memory
    mappings as it finishes (a file, so it survives a run that crashes before pytest's ``--durations`` summary)."""
    if hasattr(report, "node"):  # the xdist controller's copy of a worker's report: the worker wrote it
        return
    path = os.environ.get("COMPRL_TEST_TIMES")
    if path and (report.when == "call" or report.duration >= 1.0):
        with open(path, "a") as f:
            f.write(
                f"{report.duration:.1f}\t{report.when}\t{report.outcome}\t{report.nodeid}\t{_mappings()}\n"
            )


# XLA:CPU maps every compiled program's code and data as separate anonymous memory mappings (3 per kernel), and a
# process may hold at most vm.max_map_count (65,530 by default) of them. One pytest process compiles thousands of
# programs: by the trainer smoke tests it held ~52,000 mappings, and CI died with SIGABRT when LLVM could not map
# the next one. Dropping JAX's caches frees the executables nothing refers to any more: at the end of every module
# (fixtures that hold compiled functions live within one), and after every test of a module that sets
# ``CLEAR_JAX_CACHES_EACH_TEST = True`` (each trainer test builds its own Trainer, ~2,700 mappings of programs;
# later runs still reuse the persistent compilation cache).
@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    import gc
    import sys

    result = yield  # fixtures torn down first
    if "jax" not in sys.modules:
        return result
    each = getattr(item.module, "CLEAR_JAX_CACHES_EACH_TEST", False)
    if each or nextitem is None or nextitem.module is not item.module:
        gc.collect()
        sys.modules["jax"].clear_caches()
    return result
