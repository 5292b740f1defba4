"""Errors of the stream processor.

Tree::

    SpendgateError (schemas.exceptions)
    ├── ConfigurationError
    │   ├── RetentionTooShortError   budget.usage forgets before the windows do
    │   └── UnderReplicatedError     a topic has fewer replicas than the settings ask
    └── KafkaWaitExpired             a batch's wait on Kafka passed its bound (retriable)
"""

from __future__ import annotations

from typing import ClassVar, Literal

from spendgate.schemas.exceptions import ConfigurationError, SpendgateError

#: Which wait of a batch passed its bound (the label of ``spendgate_worker_bound_hits_total``).
KafkaWait = Literal["sends", "offsets", "read_back"]


class RetentionTooShortError(ConfigurationError):
    """``usage`` keeps records for less than the longest window plus the dedupe horizon:
    raise the topic's ``retention.ms`` to the figure in the message and restart."""


class UnderReplicatedError(ConfigurationError):
    """An existing topic has fewer replicas or a lower ``min.insync.replicas`` than
    ``SPENDGATE_KAFKA_REPLICATION_FACTOR`` / ``SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS``: raise
    the topic's, or set ``SPENDGATE_KAFKA_ALLOW_UNDER_REPLICATED=true`` to start anyway."""


class KafkaWaitExpired(SpendgateError):
    """A batch's wait on Kafka (its sends' acks, its changelog writes leaving faust's
    buffer, records read back) passed ``SPENDGATE_WORKER_KAFKA_WAIT_S``: the batch is
    committed again; if no progress follows within ``SPENDGATE_WORKER_EXIT_S`` the worker
    exits 4 for its supervisor to start it again. The diagnostics logged with the first
    one name the partitions waiting and their leaders: check those brokers."""

    retriable: ClassVar[bool] = True

    def __init__(self, wait: KafkaWait, message: str) -> None:
        super().__init__(message)
        self.wait: KafkaWait = wait
