"""Errors of the stream processor.

Tree::

    SpendgateError (schemas.exceptions)
    └── ConfigurationError
        ├── RetentionTooShortError   budget.usage forgets before the windows do
        └── UnderReplicatedError     a topic has fewer replicas than the settings ask
"""

from __future__ import annotations

from spendgate.schemas.exceptions import ConfigurationError


class RetentionTooShortError(ConfigurationError):
    """``usage`` keeps records for less than the longest window plus the dedupe horizon:
    raise the topic's ``retention.ms`` to the figure in the message and restart."""


class UnderReplicatedError(ConfigurationError):
    """An existing topic has fewer replicas or a lower ``min.insync.replicas`` than
    ``SPENDGATE_KAFKA_REPLICATION_FACTOR`` / ``SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS``: raise
    the topic's, or set ``SPENDGATE_KAFKA_ALLOW_UNDER_REPLICATED=true`` to start anyway."""
