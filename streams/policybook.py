"""The policies in force, read from the compacted ``policies`` topic."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import TopicPartition
from pydantic import ValidationError

from spendgate.schemas import kafka_connect
from spendgate.schemas.exceptions import PolicyError
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.schemas.key_ids import KeyIds
from spendgate.schemas.policies import Policy
from spendgate.streams.kafka_util import assign, stop

logger = logging.getLogger(__name__)


class PolicyBook:
    """Tails the policies topic from its start into memory; ``ready`` is set once caught up.

    With ``key_ids``, each policy is held in key-id form (``KeyIds.policy``): an exact
    ``match`` value on a secret field written raw (by an older ``policy apply``) is replaced
    by its id; a glob on such a field cannot be evaluated and is refused like an invalid one.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        topic: str,
        initial: dict[str, Policy] | None = None,
        *,
        key_ids: KeyIds | None,
    ) -> None:
        self.kafka = kafka
        self.topic = topic
        self.key_ids = key_ids
        self.policies: dict[str, Policy] = dict(initial or {})
        self.ready = asyncio.Event()
        self.version = 0
        if initial is not None:
            # Read just before start: usable at once; the tail re-reads and catches up.
            self.ready.set()

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        policy_id = key.decode()
        if value is None:
            self.policies.pop(policy_id, None)
        else:
            try:
                policy = Policy.model_validate_json(value)
                if self.key_ids is not None:
                    policy = self.key_ids.policy(policy)
            except ValidationError as exc:
                # `policy apply` validates first, so this is a foreign writer; keep the old
                # one. The reason names fields, never their values (a match may be a key).
                reason = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or 'policy'}: {e['msg']}"
                    for e in exc.errors(include_url=False)[:5]
                )
                logger.error("ignoring invalid policy record %s: %s", policy_id, reason)
                return
            except PolicyError as exc:
                logger.error("ignoring invalid policy record %s: %s", policy_id, exc)
                return
            self.policies[policy_id] = policy
        self.version += 1

    def _set_ready(self) -> None:
        logger.info("policies loaded from %s: %d in force", self.topic, len(self.policies))
        self.ready.set()

    async def run(self) -> None:
        """Consume forever; set ``ready`` after reaching the end offsets seen at start."""
        consumer = kafka_connect.consumer(self.kafka, enable_auto_commit=False)
        await consumer.start()
        try:
            tp = TopicPartition(self.topic, 0)
            await assign(consumer, [tp])
            await consumer.seek_to_beginning(tp)
            end = (await consumer.end_offsets([tp]))[tp]
            if end == 0:
                self._set_ready()
            while True:
                batch = await consumer.getmany(tp, timeout_ms=500)
                for message in batch.get(tp, []):
                    self._apply(message.key, message.value)
                # By position, not by the last message's offset: compaction may have removed
                # the records just before the end offset.
                if not self.ready.is_set() and await consumer.position(tp) >= end:
                    self._set_ready()
        finally:
            await stop(consumer)


async def read_policies(
    kafka: KafkaConnection, topic: str, *, key_ids: KeyIds | None
) -> dict[str, Policy]:
    """Read the policies topic to its current end and return the policies in force (in
    key-id form with ``key_ids``, as :class:`PolicyBook` holds them)."""
    book = PolicyBook(kafka, topic, key_ids=key_ids)
    task = asyncio.create_task(book.run())
    try:
        await asyncio.wait_for(book.ready.wait(), timeout=30)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return dict(book.policies)
