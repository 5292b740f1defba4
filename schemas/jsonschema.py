"""Export the JSON Schema of every external record, for ``spendgate schema export``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter

from spendgate.schemas.alerts import Alert
from spendgate.schemas.deadletter import DeadLetter
from spendgate.schemas.decisions import AdmitRequest, Decision
from spendgate.schemas.events import UsageEvent
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog
from spendgate.schemas.refusals import Refusal, RefusalGap
from spendgate.schemas.status import StackStatus

_DIALECT = "https://json-schema.org/draft/2020-12/schema"

#: file name -> (title, type, mode): inputs use validation mode, answers and records
#: that spendgate writes use serialization mode (what a consumer receives).
_EXPORTS: dict[str, tuple[str, Any, Literal["validation", "serialization"]]] = {
    "usage-event.json": ("UsageEvent", UsageEvent, "validation"),
    "policy.json": ("Policy", Policy, "validation"),
    "policy-list.json": ("PolicyList", list[Policy], "validation"),
    "price-catalog.json": ("PriceCatalog", PriceCatalog, "validation"),
    "admit-request.json": ("AdmitRequest", AdmitRequest, "validation"),
    "decision.json": ("Decision", Decision, "serialization"),
    "alert.json": ("Alert", Alert, "serialization"),
    "dead-letter.json": ("DeadLetter", DeadLetter, "serialization"),
    "refusal.json": ("Refusal", Refusal, "serialization"),
    "refusal-gap.json": ("RefusalGap", RefusalGap, "serialization"),
    "status.json": ("StackStatus", StackStatus, "serialization"),
}


def rendered() -> dict[str, str]:
    """Return each schema file's name and exact text as the models define it now.

    Returns:
        File name -> pretty JSON with sorted keys and a trailing newline.
    """
    out: dict[str, str] = {}
    for name, (title, kind, mode) in _EXPORTS.items():
        schema = TypeAdapter(kind).json_schema(mode=mode)
        schema = {**schema, "$schema": _DIALECT, "title": title}
        out[name] = json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return out


def export(directory: Path) -> list[Path]:
    """Write the JSON Schema files into ``directory`` (created if missing).

    The output is deterministic, so checked-in files change only when a model does.

    Args:
        directory: where to write.

    Returns:
        The written paths, in a fixed order.
    """
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
