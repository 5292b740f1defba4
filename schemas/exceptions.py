"""Exceptions shared by every spendgate package.

Tree::

    SpendgateError
    ├── ConfigurationError      a setting or file the operator supplied is wrong
    ├── PolicyError             a policy cannot be applied or used
    │   └── MissingGroupByField a request lacks a field that a policy groups by
    └── UnitError               usage cannot be turned into a policy's unit
        └── UnpricedModel       a cost_usd policy met a model with no price
"""

from __future__ import annotations

from typing import ClassVar


class SpendgateError(Exception):
    """Root of every error spendgate raises on purpose."""

    retriable: ClassVar[bool] = False


class ConfigurationError(SpendgateError):
    """A setting or file is wrong: fix the value named in the message and restart."""


class PolicyError(SpendgateError):
    """A policy is invalid or cannot be applied: correct the field named in the message."""


class MissingGroupByField(PolicyError):
    """The request lacks a subject field a policy groups by: send that field."""

    def __init__(self, policy_id: str, field: str) -> None:
        super().__init__(f"policy {policy_id!r} groups by {field!r}, which the subject lacks")
        self.policy_id = policy_id
        self.field = field


class UnitError(SpendgateError):
    """Usage cannot be converted to a policy's unit (for example an unpriced model)."""


class UnpricedModel(UnitError):
    """A ``cost_usd`` policy met a model with no price: add it to the price catalog."""

    def __init__(self, policy_id: str, model: str | None) -> None:
        shown = repr(model) if model is not None else "(none: the subject has no model)"
        super().__init__(
            f"policy {policy_id!r} counts cost_usd and model {shown} has no price "
            "(policy unpriced: reject)"
        )
        self.policy_id = policy_id
        self.model = model
