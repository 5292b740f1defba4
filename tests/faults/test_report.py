"""REPORT.md is what its command renders, never a hand edit, keeps every section, and was
made from the fault tests as they are now (product changes since are shown, not red)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

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
        assert "- Source: **unknown**" in text  # no source given
        source = {"commit": "c0ffee", "dirty": True, "uncommitted": ["streams/app.py"]}
        text = report.render(
            records,
            results,
            seconds=3,
            exit_code=1,
            pytest_args=[],
            generated="G",
            env=env,
            source=source,
        )
        assert "- Source: commit `c0ffee`, **dirty**: uncommitted changes in `streams/app.py`" in (
            text.splitlines()
        )
        assert re.search(r"## 2\. .*\n\n.*\n\n\*\*Not run\*\*", text)


class TestProvenance:
    def test_the_report_names_the_commit_it_was_generated_from(self) -> None:
        inputs = json.loads(report.INPUTS.read_text())
        source = inputs.get("source")
        assert source, f"REPORT.json records no commit: regenerate it with `{report.COMMAND}`"
        assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]), source
        assert isinstance(source["dirty"], bool)
        assert source["dirty"] == bool(source["uncommitted"])
        assert report._source_line(source) in report.REPORT.read_text().splitlines()
        # The commit is in this checkout's history (not a report from another branch).
        done = subprocess.run(
            ["git", "merge-base", "--is-ancestor", source["commit"], "HEAD"],
            cwd=report.ROOT, capture_output=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{source['commit']} is not an ancestor of HEAD"

    def test_the_fault_tests_are_those_the_report_ran(self) -> None:
        """Any file under tests/faults/ (the report's own two aside) that differs from the
        report's commit, committed since or not, or was uncommitted when it ran."""
        source = json.loads(report.INPUTS.read_text())["source"]
        changed = report.changed_since(source["commit"], report.FAULTS_DIR)
        dirty_then = [f for f in source["uncommitted"] if f.startswith(report.FAULTS_DIR + "/")]
        assert not changed and not dirty_then, (
            f"the fault tests changed after the report's commit {source['commit'][:10]} "
            f"({changed or dirty_then}): commit them, then regenerate with `{report.COMMAND}`"
        )

    def test_product_changes_since_the_report_are_shown_not_failed(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        source = json.loads(report.INPUTS.read_text())["source"]
        changed = report.changed_since(source["commit"], *report.PRODUCT_DIRS)
        line = (
            f"tests/faults/REPORT.md is of commit {source['commit'][:10]}; product files "
            f"changed since: {', '.join(changed) if changed else 'none'}"
        )
        with capsys.disabled():  # on the terminal, whatever the capture mode
            print(f"\n{line}")
        # Only ever product paths: a fault-test change is the test above's, and fails.
        assert all(f.split("/", 1)[0] in report.PRODUCT_DIRS for f in changed), changed

    def test_changed_since_sees_committed_uncommitted_and_untracked_files(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """On a scratch repository: the staleness check is not the code it trusts blindly."""
        repo = tmp_path

        def git(*args: str) -> None:
            subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                           cwd=repo, check=True, capture_output=True)  # fmt: skip

        git("init", "-q")
        (repo / "tests" / "faults").mkdir(parents=True)
        (repo / "streams").mkdir()
        for name in ("tests/faults/test_a.py", "tests/faults/REPORT.md", "streams/app.py"):
            (repo / name).write_text("v1\n")
        git("add", ".")
        git("commit", "-q", "-m", "one")
        monkeypatch.setattr(report, "ROOT", repo)
        commit = report.provenance()["commit"]
        assert report.provenance() == {"commit": commit, "dirty": False, "uncommitted": []}
        assert report.changed_since(commit, report.FAULTS_DIR) == []
        (repo / "tests/faults/REPORT.md").write_text("v2\n")  # the report's own: ignored
        assert report.changed_since(commit, report.FAULTS_DIR) == []
        (repo / "tests/faults/test_a.py").write_text("v2\n")
        (repo / "tests/faults/test_b.py").write_text("new\n")
        (repo / "streams/app.py").write_text("v2\n")
        assert report.changed_since(commit, report.FAULTS_DIR) == [
            "tests/faults/test_a.py", "tests/faults/test_b.py"]  # fmt: skip
        assert report.provenance()["dirty"] is True
        git("add", ".")
        git("commit", "-q", "-m", "two")
        assert report.changed_since(commit, *report.PRODUCT_DIRS) == ["streams/app.py"]
        assert report.provenance()["dirty"] is False
