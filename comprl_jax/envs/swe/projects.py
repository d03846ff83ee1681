"""The pinned PyPI projects SWE-Lite's tasks come from (issue 32 point 1): a static table, like envs/registry.py.

Each entry pins a source distribution by version and sha256, names the package directory bugs go into and the
pytest targets, and puts the project in the training or the held-out split (by project: no eval project is seen in
training). Chosen for: pure Python, no runtime dependencies, a test suite inside the sdist that needs only pytest,
passes on Python 3.11 and runs in seconds (the survey is in WORKSPACE "SWE-Lite").
"""

from __future__ import annotations

from comprl_jax.envs.swe.tasks import Project

# fmt: off
PROJECTS: tuple[Project, ...] = (
    # training projects
    Project("boltons", "26.2.0", "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c",
            "boltons", ("tests",)),
    Project("toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
            "toolz", ("toolz/tests",)),
    Project("cachetools", "8.0.2", "30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0",
            "src/cachetools", ("tests",), pythonpath="src"),
    Project("sqlparse", "0.6.1", "ca722573f848ff2d30e40ea30f53a104b7dea7635ea9285891263eb2c58fb6e7",
            "sqlparse", ("tests",)),
    Project("tabulate", "0.10.0", "e2cfde8f79420f6deeffdeda9aaec3b6bc5abce947655d17ac662b126e48a60d",
            "tabulate", ("test",)),
    Project("parse", "1.22.4", "706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5",
            "parse", ("tests",)),
    # held-out projects (split="eval")
    Project("semver", "3.1.2", "bea193552413194252d33ff26ce0962b76669bd1c6fb17e8e203ac37f072feaf",
            "src/semver", ("tests",), pythonpath="src", split="eval"),
    Project("webcolors", "25.10.0", "62abae86504f66d0f6364c2a8520de4a0c47b80c03fc3a5f1815fedbef7c19bf",
            "src/webcolors", ("tests",), pythonpath="src", split="eval"),
    Project("inflection", "0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
            "inflection", ("test_inflection.py",), split="eval"),
)
# tasks per project in the shipped file (launch/make_swe_tasks.py --quota scales them)
QUOTAS = {"boltons": 70, "toolz": 50, "cachetools": 50, "sqlparse": 50, "tabulate": 40, "parse": 40,
          "semver": 40, "webcolors": 30, "inflection": 30}
# fmt: on


def get(name: str, version: str) -> Project:
    for p in PROJECTS:
        if p.name == name and p.version == version:
            return p
    known = ", ".join(p.key for p in PROJECTS)
    raise KeyError(
        f"SWE-Lite project {name}=={version} is not pinned in comprl_jax/envs/swe/projects.py ({known})"
    )
