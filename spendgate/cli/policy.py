"""Configuration: ``policy apply|list|delete``, ``schema export`` and ``key-id``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from spendgate._cli_output import console, policy_table, say
from spendgate.cli._options import Output, echo_json, group

__all__ = ["key_id", "policy", "schema"]

policy = group("Apply, list and delete budget policies.")
schema = group("The JSON Schemas of events, policies and API bodies.")


@policy.command("apply")
def policy_apply(
    file: Annotated[
        Path,
        typer.Argument(
            help="A YAML or JSON file: one policy or a list.", exists=True, dir_okay=False
        ),
    ],
) -> None:
    """Validate policies from FILE and publish them; a bad file changes nothing.

    Waits for Kafka at most SPENDGATE_POLICY_TIMEOUT_S (30 s) in all, then exits 3.
    """
    from spendgate.streams.policy_admin import apply_file, policy_settings

    settings = policy_settings()
    for applied in apply_file(settings, file, timeout_s=settings.policy_timeout_s):
        say("applied", "green", applied)


@policy.command("list")
def policy_list(output: Output = "table") -> None:
    """List the policies in force (waiting for Kafka at most SPENDGATE_POLICY_TIMEOUT_S).

    --output json: a list of the policies, every field (as `policy apply` reads them).
    """
    from spendgate.streams.policy_admin import list_policies, policy_settings

    settings = policy_settings()
    if output == "json":
        listed = list_policies(settings, timeout_s=settings.policy_timeout_s)
        echo_json([p.model_dump(mode="json") for p in listed])
        return
    Console().print(policy_table(list_policies(settings, timeout_s=settings.policy_timeout_s)))


@policy.command("delete")
def policy_delete(policy_id: Annotated[str, typer.Argument(help="The policy id.")]) -> None:
    """Delete a policy (a tombstone on the policies topic).

    Waits for Kafka at most SPENDGATE_POLICY_TIMEOUT_S (30 s) in all, then exits 3.
    """
    from spendgate.streams.policy_admin import delete_policy, policy_settings

    settings = policy_settings()
    delete_policy(settings, policy_id, timeout_s=settings.policy_timeout_s)
    say("deleted", "", policy_id)


@schema.command("export")
def schema_export(
    directory: Annotated[
        Path, typer.Argument(help="Where to write the *.schema.json files.", file_okay=False)
    ] = Path("schemas/json"),
) -> None:
    """Write the JSON Schema files of the models (checked in under schemas/json)."""
    from spendgate.schemas.jsonschema import export

    for path in export(directory):
        console.print(f"wrote {path}")


def key_id(
    value: Annotated[str, typer.Argument(help="The raw value (an API key, ...).")],
    field: Annotated[
        str, typer.Option("--field", help="The subject field it is sent in.")
    ] = "api_key",
) -> None:
    """Print the key id a secret subject value is stored as (budget keys, events, alerts).

    Uses the deployment's SPENDGATE_SUBJECT_SECRET_FILE (or SPENDGATE_SUBJECT_SECRET) and
    SPENDGATE_SECRET_FIELDS, as every service does. Pass the value as an argument only
    where your shell history is safe; '-' reads it from stdin.
    """
    from spendgate.streams.settings import WorkerSettings

    keys = WorkerSettings().key_ids()
    if not keys.secret_field(field):
        raise typer.BadParameter(
            f"{field!r} is not a secret field (SPENDGATE_SECRET_FIELDS: "
            f"{','.join(keys.fields) or 'none'}): it is stored as sent",
            param_hint="--field",
        )
    raw = sys.stdin.readline().rstrip("\r\n") if value == "-" else value
    if keys.built_in:
        note = "no SPENDGATE_SUBJECT_SECRET(_FILE): the public built-in secret"
        say("note", "yellow", note, out=Console(stderr=True))
    typer.echo(keys.of(raw, field))
