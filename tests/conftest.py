"""Test set-up: 8 fake CPU devices for sharding tests, set before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (still run in CI)")


def pytest_runtest_logreport(report):
    """``COMPRL_TEST_TIMES=<file>``: append each test's set-up / call / tear-down time as it finishes (a file, so it
    survives a run that crashes before pytest's own ``--durations`` summary)."""
    path = os.environ.get("COMPRL_TEST_TIMES")
    if path and (report.when == "call" or report.duration >= 1.0):
        with open(path, "a") as f:
            f.write(f"{report.duration:.1f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")
