"""Test configuration: fixture plugins, hypothesis profiles and the per-run seed.

Every random input varies from run to run (CI included) and derives from one seed,
``tests.fixtures.seeds.RUN_SEED``: printed in the header and beside each failure, and set
with ``SPENDGATE_TEST_SEED=<n>`` to reproduce a run. Hypothesis gets the same seed through
its global seed (what ``--hypothesis-seed`` sets), so its examples reproduce too. That seed
is the same number for every property: hypothesis seeds each test's generator with it as it
is (``hypothesis.core.get_random_for_wrapped_test``), it derives nothing per test, so two
properties drawing the same strategies draw the same examples within a run; across runs
they all change.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import core as hypothesis_core

from tests.fixtures.key_ids import TEST_SECRET
from tests.fixtures.logs import tail
from tests.fixtures.seeds import RUN_SEED, SEED_ENV, reproduce_hint

pytest_plugins = [
    "tests.fixtures.services",
    "tests.fixtures.factories",
    "tests.fixtures.pipeline",
    "tests.fixtures.admission",
    "tests.fixtures.embedded_lua",
    "tests.fixtures.dashboard",
    "tests.fixtures.helm",
    "tests.fixtures.litellm_stack",
    "tests.fixtures.cluster",
    "tests.fixtures.blackhole",
]

# The suite writes its tokens and secret files owner-only (admission refuses a tokens file
# others can read, or its group write). Tests of the modes chmod explicitly.
os.umask(0o077)
# One subject secret for every service the suite starts (tests.fixtures.key_ids).
os.environ["SPENDGATE_SUBJECT_SECRET"] = TEST_SECRET

# One seed for the whole run: pytest-xdist's workers (scripts/test runs two) start after
# this module is imported in the controller and inherit its environment, so every worker
# draws from the seed the header prints.
os.environ[SEED_ENV] = str(RUN_SEED)

IN_CI = os.environ.get("CI") == "true"
#: Examples per property: 2,000 in CI, fewer locally.
CI_EXAMPLES = 2000
DEV_EXAMPLES = 200

# Both profiles name their parent and set derandomize explicitly: a profile registered
# without a parent inherits whatever is loaded, and under CI=true that is Hypothesis's
# built-in "ci" profile with derandomize=True (the same examples on every run).
_common = settings(
    parent=settings.get_profile("default"),
    derandomize=False,
    deadline=None,
    print_blob=True,
)
settings.register_profile("spendgate-dev", _common, max_examples=DEV_EXAMPLES)
settings.register_profile(
    "spendgate-ci",
    _common,
    max_examples=CI_EXAMPLES,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("spendgate-ci" if IN_CI else "spendgate-dev")


def pytest_configure(config: pytest.Config) -> None:
    # --hypothesis-seed on the command line wins; else every property runs on this run's
    # seed, the same one for each test (hypothesis derives no per-test seed from it), and
    # SPENDGATE_TEST_SEED reproduces it.
    if config.getoption("hypothesis_seed", default=None) is None:
        hypothesis_core.global_force_seed = RUN_SEED


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"spendgate: {reproduce_hint()}"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report: pytest.TestReport = yield
    if report.failed:
        report.sections.append(("spendgate seed", reproduce_hint()))
        for log in getattr(item, "spendgate_logs", lambda: [])():
            report.sections.append((f"tail of {log.name}", tail(log)))
    return report


#: Test files that use the shared Redis Cluster (any ``pytest.mark.cluster`` in them): they
#: kill and heal its nodes, and its session fixture starts it once and stops it at the end
#: of the worker's session, so they all run on one xdist worker.
CLUSTER_FILES = frozenset(
    path.relative_to(Path(__file__).parent.parent).as_posix()
    for path in Path(__file__).parent.rglob("test_*.py")
    if "pytest.mark.cluster" in path.read_text()
)


def xdist_scope(nodeid: str) -> str:
    """The scheduling unit of a test under pytest-xdist: its file (its module fixtures start
    once), or ``redis-cluster`` for every file on the shared Redis Cluster."""
    path = nodeid.split("::", 1)[0]
    return "redis-cluster" if path in CLUSTER_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Schedule by :func:`xdist_scope`. (xdist 3.8's ``loadgroup`` suffixes node ids in a
    way pytest 9 ignores, so its groups never form: the scope is decided here instead.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ByScope(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test on the shared cluster outside CLUSTER_FILES would be scheduled on its own
    # worker, which would start and stop the cluster under the other's tests: refuse it.
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if "redis_cluster" in getattr(item, "fixturenames", ()) and path not in CLUSTER_FILES:
            raise pytest.UsageError(
                f"{item.nodeid} uses the shared Redis Cluster: mark it pytest.mark.cluster "
                "(tests/conftest.py schedules those files on one xdist worker)"
            )
