"""The client runs inside inference workers: importing it must not load the server's stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_DEPENDENCIES = ("fastapi", "starlette", "redis", "aiokafka", "uvicorn", "faust")

PROBE = f"""
import json, sys
import {{module}}
print(json.dumps(sorted(m for m in {SERVER_DEPENDENCIES!r} if m in sys.modules)))
"""


class TestClientImports:
    @pytest.mark.parametrize(
        "module", ["spendgate.admission.client", "spendgate.admission", "spendgate"]
    )
    def test_importing_the_client_loads_no_server_dependency(self, module: str) -> None:
        probe = subprocess.run(
            [sys.executable, "-c", PROBE.format(module=module)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert json.loads(probe.stdout) == []

    def test_the_server_names_still_resolve_from_the_package(self) -> None:
        from spendgate import admission
        from spendgate.admission.store import BudgetStore

        assert admission.BudgetStore is BudgetStore
        with pytest.raises(AttributeError, match="no attribute 'nothing'"):
            _ = admission.nothing  # type: ignore[attr-defined]
