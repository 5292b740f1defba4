"""REPORT.md is what its command renders, never a hand edit, and keeps every section."""

from __future__ import annotations

import json
import re

import pytest

from tests.faults import report

SECTIONS = [
    *(f"## {n}. {title}" for n, (title, _) in report.SCENARIOS.items()),
    "## Known bugs (reproduced by xfail-strict tests)",
    "## Failures in this run",
    "## Other observations",
    "## Not covered",
]


def _headings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


class TestReport:
    def test_report_md_is_exactly_the_rendering_of_its_inputs(self) -> None:
        assert report.INPUTS.exists(), f"run `{report.COMMAND}` (it writes REPORT.json too)"
        inputs = json.loads(report.INPUTS.read_text())
        assert report.REPORT.read_text() == report.render_inputs(inputs), (
            f"tests/faults/REPORT.md differs from its rendering: regenerate it with "
            f"`{report.COMMAND}`, do not edit it"
        )

    def test_report_md_has_every_section_and_the_current_texts(self) -> None:
        text = report.REPORT.read_text()
        assert _headings(text) == SECTIONS
        not_covered = text.split("## Not covered", 1)[1]
        assert report.MISSING.strip() in not_covered
        assert report.OBSERVATIONS.strip() in text

    def test_every_recorded_test_of_the_run_is_in_the_report(self) -> None:
        inputs = json.loads(report.INPUTS.read_text())
        text = report.REPORT.read_text()
        for record in inputs["records"]:
            assert f"(`{record['test']}`)" in text
        # Every fault test of the run reported an outcome (none silently missing).
        assert {r["test"] for r in inputs["records"]} <= set(inputs["results"])

    def test_rendering_lists_known_bugs_failures_and_not_covered(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(report, "FIXES", {"test_known": "its cause and fix"})
        xfail = "tests/faults/test_x.py::TestX::test_known"
        failed = "tests/faults/test_x.py::TestX::test_broken"
        records = [
            {"scenario": "3", "test": xfail, "faults": ["f"], "figures": {"units_lost": 0},
             "inputs": [], "notes": []},
            {"scenario": "1", "test": failed, "faults": [], "figures": {"units_lost": 7},
             "inputs": [], "notes": []},
        ]  # fmt: skip
        results = {
            xfail: {"outcome": "xfail (known bug)", "seconds": 1.0, "message": "reason: r"},
            failed: {"outcome": "FAILED", "seconds": 2.0, "message": "assert 7 == 0"},
        }
        env = {"python": "3.11", "ci": "true", "kafka": "k", "redis": "r", "seed": "42"}
        text = report.render(
            records, results, seconds=3, exit_code=1, pytest_args=[], generated="G", env=env
        )
        assert _headings(text) == SECTIONS
        known = text.split("## Known bugs", 1)[1].split("## Failures", 1)[0]
        assert xfail in known and report.FIXES[xfail.split("::")[-1]] in known
        failures = text.split("## Failures in this run", 1)[1].split("## Other", 1)[0]
        assert failed in failures and "assert 7 == 0" in failures
        assert "SPENDGATE_TEST_SEED=42" in text
        assert re.search(r"## 2\. .*\n\n.*\n\n\*\*Not run\*\*", text)
