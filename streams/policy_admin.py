"""``spendgate policy apply|list|delete``: validate, publish and read policies.

Each command waits for Kafka at most ``SPENDGATE_POLICY_TIMEOUT_S`` in all (creating or
checking the topics, the writes and their acks, reading the policies in force): a broker
that does not answer in time, one that accepts connections and never replies included,
ends it with a :class:`TimeoutError` naming what to check, which ``spendgate`` prints as
one ``error:`` line and exits 3 on. Running a command cut short again is safe: a policy
is a record keyed by its id on a compacted topic, so one written twice is the same policy.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
)
from pydantic import Field, ValidationError

from spendgate.schemas import kafka_connect
from spendgate.schemas.exceptions import PolicyError
from spendgate.schemas.key_ids import KeyIds
from spendgate.schemas.key_settings import settings_error
from spendgate.schemas.policies import Policy, validate_against_catalog
from spendgate.schemas.prices import PriceCatalog, load_catalog
from spendgate.streams.policybook import read_policies
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.topics import ensure_topics

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a ``policy`` command waits for Kafka in all, unless
#: ``SPENDGATE_POLICY_TIMEOUT_S`` says otherwise.
POLICY_TIMEOUT_S = 30.0
#: How long stopping the producer may take: aiokafka's ``stop()`` waits for every batch
#: still unacked, which a broker gone silent never acks.
STOP_S = 1.0


class PolicySettings(WorkerSettings):
    """The ``policy`` commands' settings: the worker's (Kafka, topics, key ids, prices)
    and the bound on their wait for Kafka."""

    policy_timeout_s: float = Field(
        POLICY_TIMEOUT_S,
        gt=0,
        description="The longest `policy apply`, `delete` and `list` each wait for Kafka in "
        "all (topics, writes and their acks, the read of the policies in force); then one "
        "`error:` line naming the step, exit 3. Running the command again is safe.",
    )


def policy_settings() -> PolicySettings:
    """The ``policy`` commands' settings, read from the environment.

    Raises:
        ConfigurationError: one line naming what is refused (a
            ``SPENDGATE_POLICY_TIMEOUT_S`` of 0 or less among them).
    """
    try:
        return PolicySettings()
    except ValidationError as exc:
        raise settings_error(exc, "SPENDGATE_") from None


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


@dataclass
class _Run:
    """One ``policy`` command's run: its deadline, and where it got to (named by the error
    line when Kafka does not answer)."""

    step: str = "connecting"
    #: The keys of the records (policies, or a tombstone) the command writes, in order.
    writing: list[str] = field(default_factory=list)
    #: Those the brokers acked.
    written: list[str] = field(default_factory=list)
    #: The command's bound (None: none, as when :func:`publish_policies` is called directly).
    deadline: asyncio.Timeout | None = None

    def outcome(self) -> str:
        """What the brokers confirmed, for the error line."""
        unconfirmed = [key for key in self.writing if key not in self.written]
        if not unconfirmed:
            return "nothing was written"
        written = f"written: {', '.join(self.written)}; " if self.written else ""
        return f"{written}not confirmed: {', '.join(unconfirmed)} (running it again is safe)"


#: What aiokafka raises when a broker does not answer (or cannot be reached) in its own
#: request timeout: the same outcome as the command's bound running out.
NO_ANSWER = (
    TimeoutError,
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
)


async def publish_policies(
    settings: WorkerSettings, policies: list[Policy], run: _Run | None = None
) -> None:
    """Write policies to the compacted policies topic (key = policy id), each in key-id
    form (``KeyIds.policy``): no raw secret value reaches the topic.

    Raises:
        PolicyError: a policy has a glob on a secret field (nothing is written).
    """
    keys = settings.key_ids()
    policies = [keys.policy(p) for p in policies]
    run = run or _Run()
    run.step = "creating or checking the topics"
    await ensure_topics(settings)
    records = [(p.id, p.model_dump_json().encode()) for p in policies]
    await _write(settings, records, run)


async def _write(
    settings: WorkerSettings, records: Sequence[tuple[str, bytes | None]], run: _Run
) -> None:
    """Write ``records`` (key, value; None: a tombstone) to the policies topic, each acked
    by every in-sync replica before the next; the producer is then stopped within
    :data:`STOP_S`, outside the command's bound once everything is acked."""
    run.writing = [key for key, _ in records]
    run.step = "starting the producer"
    producer = kafka_connect.producer(settings.kafka(), acks="all", enable_idempotence=True)
    try:
        await producer.start()
        for key, value in records:
            run.step = f"writing {key!r}"
            await producer.send_and_wait(settings.topic("policies"), value, key=key.encode())
            run.written.append(key)
    except BaseException:
        await _stop(producer)
        raise
    if run.deadline is not None:
        run.deadline.reschedule(None)  # all acked: a slow stop must not fail the command
    await _stop(producer)


async def _stop(producer: AIOKafkaProducer) -> None:
    """Stop ``producer`` within :data:`STOP_S` (what it still holds was never acked)."""
    try:
        await asyncio.wait_for(producer.stop(), STOP_S)
    except Exception as exc:  # noqa: BLE001 - the command's outcome is already decided
        logger.debug("the policies producer did not stop cleanly: %r", exc)


def _ignore_abandoned_clients(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler while a ``policy`` command runs: a Kafka client
    whose start the bound cut short (the policies reader's consumer, which
    ``read_policies`` does not stop then) is left unclosed on purpose, since the command
    ends with its error line; anything else is reported as usual."""
    if str(context.get("message", "")).startswith("Unclosed AIOKafka"):
        logger.debug("%s (its start was cut short by the bound)", context["message"])
        return
    loop.default_exception_handler(context)


def _bounded(
    settings: WorkerSettings,
    command: str,
    timeout_s: float,
    work: Callable[[_Run], Coroutine[Any, Any, T]],
) -> T:
    """Run ``work`` within ``timeout_s`` (a producer's stop may add :data:`STOP_S`).

    Raises:
        TimeoutError: Kafka did not answer in time (or aiokafka gave up reaching it): one
            line naming the command, the step, the settings to check, and what was written.
    """
    run = _Run()

    async def bounded() -> T:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_ignore_abandoned_clients)
        started = loop.time()
        try:
            async with asyncio.timeout(timeout_s) as run.deadline:
                return await work(run)
        except NO_ANSWER as exc:
            cause = "" if isinstance(exc, TimeoutError) else f" ({exc})"
            written = "" if command == "list" else f"; {run.outcome()}"
            raise TimeoutError(
                f"policy {command}: Kafka at {settings.kafka_bootstrap} did not answer while "
                f"{run.step}{cause}; gave up after {loop.time() - started:.1f} s "
                f"(SPENDGATE_POLICY_TIMEOUT_S={timeout_s:g}): check SPENDGATE_KAFKA_BOOTSTRAP "
                f"and SPENDGATE_KAFKA_SECURITY_PROTOCOL, and that those brokers are up{written}"
            ) from None

    return asyncio.run(bounded())


def apply_file(
    settings: WorkerSettings, path: Path, *, timeout_s: float = POLICY_TIMEOUT_S
) -> list[str]:
    """Validate every policy in ``path`` first, then publish them all (waiting for Kafka
    at most ``timeout_s``); return their ids.

    Raises:
        PolicyError: a policy is invalid, or names a price the catalog lacks.
        TimeoutError: Kafka did not answer within ``timeout_s`` (see :func:`_bounded`).
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
    _bounded(
        settings,
        "apply",
        timeout_s,
        lambda run: publish_policies(settings, policies, run),
    )
    return [p.id for p in policies]


async def _in_force(settings: WorkerSettings, run: _Run) -> dict[str, Policy]:
    run.step = "reading the policies in force"
    return await read_policies(
        settings.kafka(), settings.topic("policies"), key_ids=settings.key_ids()
    )


def list_policies(settings: WorkerSettings, *, timeout_s: float = POLICY_TIMEOUT_S) -> list[Policy]:
    """The policies in force, sorted by id (read within ``timeout_s``).

    Raises:
        TimeoutError: Kafka did not answer within ``timeout_s`` (see :func:`_bounded`).
    """
    found = _bounded(settings, "list", timeout_s, lambda run: _in_force(settings, run))
    return sorted(found.values(), key=lambda p: p.id)


def delete_policy(
    settings: WorkerSettings, policy_id: str, *, timeout_s: float = POLICY_TIMEOUT_S
) -> None:
    """Publish a tombstone for ``policy_id``, once it is seen in force (both within
    ``timeout_s``).

    Raises:
        PolicyError: no such policy is in force.
        TimeoutError: Kafka did not answer within ``timeout_s`` (see :func:`_bounded`).
    """

    async def tombstone(run: _Run) -> None:
        if policy_id not in await _in_force(settings, run):
            raise PolicyError(f"no policy {policy_id!r} is in force")
        await _write(settings, [(policy_id, None)], run)

    _bounded(settings, "delete", timeout_s, tombstone)
