"""``spendgate policy apply|list|delete``: validate, publish and read policies."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import yaml
from pydantic import ValidationError

from spendgate.schemas import kafka_connect
from spendgate.schemas.exceptions import PolicyError
from spendgate.schemas.key_ids import KeyIds
from spendgate.schemas.policies import Policy, validate_against_catalog
from spendgate.schemas.prices import PriceCatalog, load_catalog
from spendgate.streams.policybook import read_policies
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.topics import ensure_topics


def load_policies(path: Path, *, key_ids: KeyIds | None) -> list[Policy]:
    """Read and validate one policy or a list of policies from a YAML or JSON file.

    Args:
        path: the file.
        key_ids: with them, each policy in key-id form (``KeyIds.policy``): an exact
            ``match`` value on a secret field is replaced by its key id.

    Raises:
        PolicyError: the file cannot be parsed or a policy is invalid (the message names
            the policy and the field; a glob on a secret field is invalid).
    """
    try:
        raw = (
            yaml.safe_load(path.read_text())
            if path.suffix in {".yaml", ".yml"}
            else (json.loads(path.read_text()))
        )
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise PolicyError(f"{path}: not valid YAML/JSON: {exc}") from exc
    items = raw if isinstance(raw, list) else [raw]
    policies: list[Policy] = []
    problems: list[str] = []
    for n, item in enumerate(items):
        try:
            policy = Policy.model_validate(item)
            policies.append(key_ids.policy(policy) if key_ids is not None else policy)
        except ValidationError as exc:
            problems.extend(_describe(n, item, exc))
        except PolicyError as exc:
            problems.append(f"policy {n} (id {policy.id!r}) {exc}")
    ids = [p.id for p in policies]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        problems.append(f"policy ids must be unique within the file (repeated: {', '.join(dup)})")
    if problems:
        raise PolicyError(f"{path}: {len(problems)} invalid:\n" + "\n".join(problems))
    return policies


def _describe(n: int, item: object, exc: ValidationError) -> list[str]:
    """One line per invalid field of policy number ``n`` (0-based), named and unmangled."""
    pid = item.get("id") if isinstance(item, dict) else None
    who = f"policy {n}" + (f" (id {pid!r})" if isinstance(pid, str) else "")
    lines = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "(policy)"
        # A match value may be a secret (an API key): never repeated.
        shown = err["loc"] and err["type"] != "missing" and err["loc"][0] != "match"
        got = f" (got {err['input']!r})" if shown else ""
        lines.append(f"{who} field {where}: {err['msg']}{got}")
    return lines


async def publish_policies(settings: WorkerSettings, policies: list[Policy]) -> None:
    """Write policies to the compacted policies topic (key = policy id), each in key-id
    form (``KeyIds.policy``): no raw secret value reaches the topic.

    Raises:
        PolicyError: a policy has a glob on a secret field (nothing is written).
    """
    keys = settings.key_ids()
    policies = [keys.policy(p) for p in policies]
    await ensure_topics(settings)
    async with kafka_connect.producer(
        settings.kafka(), acks="all", enable_idempotence=True
    ) as producer:
        for p in policies:
            await producer.send_and_wait(
                settings.topic("policies"), p.model_dump_json().encode(), key=p.id.encode()
            )


def apply_file(settings: WorkerSettings, path: Path) -> list[str]:
    """Validate every policy in ``path`` first, then publish them all; return their ids.

    Raises:
        PolicyError: a policy is invalid, or names a price the catalog lacks.
    """
    policies = load_policies(path, key_ids=settings.key_ids())
    # Without a catalog nothing is priced: a downgrade target or a default rate is refused.
    catalog = load_catalog(settings.prices_file) if settings.prices_file else PriceCatalog()
    problems = []
    for p in policies:
        try:
            validate_against_catalog(p, catalog)
        except PolicyError as exc:
            problems.append(str(exc))
    if problems:
        raise PolicyError(f"{path}: {len(problems)} invalid:\n" + "\n".join(problems))
    asyncio.run(publish_policies(settings, policies))
    return [p.id for p in policies]


def list_policies(settings: WorkerSettings) -> list[Policy]:
    """The policies in force, sorted by id."""
    found = asyncio.run(
        read_policies(settings.kafka(), settings.topic("policies"), key_ids=settings.key_ids())
    )
    return sorted(found.values(), key=lambda p: p.id)


def delete_policy(settings: WorkerSettings, policy_id: str) -> None:
    """Publish a tombstone for ``policy_id``.

    Raises:
        PolicyError: no such policy is in force.
    """
    if policy_id not in {p.id for p in list_policies(settings)}:
        raise PolicyError(f"no policy {policy_id!r} is in force")

    async def _tombstone() -> None:
        async with kafka_connect.producer(
            settings.kafka(), acks="all", enable_idempotence=True
        ) as producer:
            await producer.send_and_wait(settings.topic("policies"), None, key=policy_id.encode())

    asyncio.run(_tombstone())
