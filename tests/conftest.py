"""Test configuration: fixture plugins and hypothesis profiles."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

pytest_plugins = [
    "tests.fixtures.services",
    "tests.fixtures.factories",
    "tests.fixtures.pipeline",
    "tests.fixtures.admission",
    "tests.fixtures.embedded_lua",
]

settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile(
    "ci", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")
