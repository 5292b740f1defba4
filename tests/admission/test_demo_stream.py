"""The demo's stream step on the demo's own policy: stopped by a refused extend at the limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from spendgate._demo_showcase import stream_and_overage
from spendgate.streams.policy_admin import load_policies
from tests.fixtures.admission import MakeAdmission

pytestmark = pytest.mark.integration

POLICIES = Path(__file__).parents[2] / "examples" / "demo-policies.yaml"


async def test_the_stream_stops_at_the_limit_and_commits_what_it_used(
    make_admission: MakeAdmission,
) -> None:
    adm = await make_admission()
    await adm.policies(*load_policies(POLICIES, key_ids=None))
    lines: list[str] = []
    shown = await stream_and_overage(adm.http, lines.append, absorb_timeout_s=0.5)
    # No worker here: the overage's commit is never applied, so cap_next is not shown (the
    # second admit's reserved holds the first, unabsorbed reservation too: not evidence).
    assert shown == {"stream stopped by a refused extend"}
    assert lines[0] == (
        "stream: 4 extends granted, stopped at 1500 output tokens when extend 5 was refused "
        "(remaining {'hooli-stream-output': 0}); committed 1500"
    )
    assert lines[1].startswith("overage: estimated 200, committed 500; the worker did not apply")
    kinds = [e.kind for e in adm.publisher.events]  # type: ignore[attr-defined]
    assert kinds.count("extend") == 4 and kinds.count("commit") == 3
