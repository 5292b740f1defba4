"""The checked-in JSON Schema files match the models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spendgate import schemas
from spendgate.schemas.jsonschema import export, rendered

CHECKED_IN = Path(schemas.__file__).parent / "json"
HINT = "JSON Schema out of date: run `spendgate schema export` and commit schemas/json/"


class TestCheckedInSchemas:
    @pytest.mark.parametrize("name", sorted(rendered()))
    def test_each_file_matches_the_models(self, name: str) -> None:
        path = CHECKED_IN / name
        assert path.is_file(), f"{path} is missing. {HINT}"
        assert path.read_text(encoding="utf-8") == rendered()[name], f"{path} differs. {HINT}"

    def test_no_stale_files(self) -> None:
        assert sorted(p.name for p in CHECKED_IN.glob("*.json")) == sorted(rendered()), HINT


class TestExport:
    def test_writes_every_file_deterministically(self, tmp_path: Path) -> None:
        first = {p.name: p.read_bytes() for p in export(tmp_path / "a")}
        second = {p.name: p.read_bytes() for p in export(tmp_path / "a")}
        assert first == second
        assert set(first) == {
            "usage-event.json",
            "policy.json",
            "policy-list.json",
            "price-catalog.json",
            "admit-request.json",
            "decision.json",
            "alert.json",
            "dead-letter.json",
            "refusal.json",
            "refusal-gap.json",
            "status.json",
        }

    def test_files_are_pretty_sorted_json_with_a_trailing_newline(self) -> None:
        for name, text in rendered().items():
            schema = json.loads(text)
            assert text == json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema", name
            assert schema["title"]

    def test_the_event_schema_is_a_union_discriminated_on_kind(self) -> None:
        schema = json.loads(rendered()["usage-event.json"])
        assert schema["discriminator"]["propertyName"] == "kind"
        assert len(schema["oneOf"]) == 5
