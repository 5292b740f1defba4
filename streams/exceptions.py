"""Errors of the stream processor.

Tree::

    SpendgateError (schemas.exceptions)
    └── ConfigurationError
        └── RetentionTooShortError   budget.usage forgets before the windows do
"""

from __future__ import annotations

from spendgate.schemas.exceptions import ConfigurationError


class RetentionTooShortError(ConfigurationError):
    """``usage`` keeps records for less than the longest window plus the dedupe horizon:
    raise the topic's ``retention.ms`` to the figure in the message and restart."""
