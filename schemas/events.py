"""Usage events on ``budget.usage``: a discriminated union on ``kind``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal, Self

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    model_validator,
)

from spendgate.schemas.types import Amount, Identifier, SignedAmount, SubjectValue, epoch_ms


def _to_utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _since_epoch(value: datetime) -> datetime:
    # Buckets are aligned to the Unix epoch; nothing before it can be counted.
    if value < _EPOCH:
        raise ValueError("must not be before 1970-01-01T00:00:00Z")
    return value


#: An RFC 3339 instant with an offset (naive times are refused), normalized to UTC.
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_to_utc)]
#: An event time: a :data:`UtcDatetime` not before the Unix epoch.
EventDatetime = Annotated[AwareDatetime, AfterValidator(_to_utc), AfterValidator(_since_epoch)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Subject(_Frozen):
    """Who or what a request is for; policies match and group on these fields."""

    tenant: SubjectValue | None = None
    team: SubjectValue | None = None
    project: SubjectValue | None = None
    api_key: SubjectValue | None = None
    user: SubjectValue | None = None
    model: SubjectValue | None = None
    #: The provider, region or cluster serving the request (what ``route`` changes).
    pool: SubjectValue | None = None
    env: SubjectValue | None = None
    labels: dict[SubjectValue, SubjectValue] = Field(default_factory=dict, max_length=32)

    def value(self, field: str) -> str | None:
        """Return a subject field, or ``labels.NAME`` for a free label."""
        if field.startswith("labels."):
            return self.labels.get(field.removeprefix("labels."))
        found = getattr(self, field, None)
        return found if isinstance(found, str) else None


class _Amounts(_Frozen):
    @model_validator(mode="before")
    @classmethod
    def _json_numbers(cls, data: object) -> object:
        # JSON numbers only: "100" and true are refused rather than read as 100 and 1 (5.0
        # is an integer in JSON Schema's sense and is accepted; 5.5 is refused).
        if isinstance(data, dict):
            for name, value in data.items():
                if isinstance(value, str | bool):
                    raise ValueError(f"{name}: must be a JSON integer, not {value!r}")
        return data


class Usage(_Amounts):
    """What a request used (or is estimated to use). Every field is a non-negative integer."""

    requests: Amount = 0
    input_tokens: Amount = 0
    cached_input_tokens: Amount = 0
    output_tokens: Amount = 0
    gpu_ms: Amount = 0
    cost_usd_micros: Amount | None = None


class SignedUsage(_Amounts):
    """A correction: like :class:`Usage` but each field may be negative."""

    requests: SignedAmount = 0
    input_tokens: SignedAmount = 0
    cached_input_tokens: SignedAmount = 0
    output_tokens: SignedAmount = 0
    gpu_ms: SignedAmount = 0
    cost_usd_micros: SignedAmount | None = None


#: Every event's ``kind``, as each record of the usage topic carries it.
EventKind = Literal["reserve", "extend", "commit", "release", "adjust"]


class _Event(_Frozen):
    schema_version: Literal[1] = 1
    event_id: Identifier
    subject: Subject
    occurred_at: EventDatetime

    @property
    def occurred_ms(self) -> int:
        """``occurred_at`` in integer milliseconds since the epoch (exact, floored)."""
        return epoch_ms(self.occurred_at)


class ReserveEvent(_Event):
    """Admission held capacity for a request (published by the admission service)."""

    kind: Literal["reserve"] = "reserve"
    reservation_id: Identifier
    usage: Usage
    expires_at: EventDatetime

    @property
    def expires_ms(self) -> int:
        """``expires_at`` in integer milliseconds since the epoch (exact, floored)."""
        return epoch_ms(self.expires_at)

    @model_validator(mode="after")
    def _expires_later(self) -> Self:
        if self.expires_at <= self.occurred_at:
            raise ValueError("expires_at: must be later than occurred_at")
        return self


class CommitEvent(_Event):
    """The final charge, replacing its reservation when it names one."""

    kind: Literal["commit"] = "commit"
    usage: Usage
    reservation_id: Identifier | None = None


class ExtendEvent(_Event):
    """A streaming reservation grew by ``usage`` at ``occurred_at`` (published by admission).

    ``seq`` numbers the extends of one reservation; the event id derives from the
    reservation id and ``seq``, so a retried extend is one event.
    """

    kind: Literal["extend"] = "extend"
    reservation_id: Identifier
    seq: int = Field(ge=1, le=2**31 - 1)
    usage: Usage


class ReleaseEvent(_Event):
    """A reservation ended without a charge."""

    kind: Literal["release"] = "release"
    reservation_id: Identifier


class AdjustEvent(_Event):
    """A signed correction charged in the bucket of its ``occurred_at``."""

    kind: Literal["adjust"] = "adjust"
    usage: SignedUsage
    ref_event_id: Identifier | None = None


UsageEvent = Annotated[
    ReserveEvent | ExtendEvent | CommitEvent | ReleaseEvent | AdjustEvent,
    Field(discriminator="kind"),
]
usage_event_adapter: TypeAdapter[UsageEvent] = TypeAdapter(UsageEvent)


def parse_event(raw: bytes | str) -> UsageEvent:
    """Validate one JSON record from ``budget.usage``.

    Raises:
        pydantic.ValidationError: the record is not a valid event; the error names the field.
    """
    return usage_event_adapter.validate_json(raw)


def partition_key(subject: Subject) -> bytes:
    """Record key on ``budget.usage``: the tenant, ``_`` when absent."""
    return (subject.tenant or "_").encode()


def extend_event_id(reservation_id: str, seq: int) -> str:
    """The event id of a reservation's ``seq``-th extend (also its pending entry's name)."""
    return f"extend-{seq}-{reservation_id}"
