"""Budget policies: what is counted, for whom, over which trailing window."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from spendgate.schemas.burst import BurstSpec
from spendgate.schemas.exceptions import PolicyError
from spendgate.schemas.types import (
    MAX_AMOUNT,
    Boundary,
    Duration,
    FailureMode,
    Mode,
    OnExceed,
    OverageMode,
    PolicyId,
    SubjectFieldName,
    SubjectValue,
    Unit,
    Unpriced,
    parse_duration_ms,
)

if TYPE_CHECKING:
    from spendgate.schemas.prices import PriceCatalog

_MIN_WINDOW_MS = 30_000
MAX_WINDOW_MS = 31 * 86_400_000
_MIN_TTL_MS = 1_000
_MAX_TTL_MS = 86_400_000
_MAX_DELAY_MS = 60_000
_DELAYING: frozenset[str] = frozenset({"delay"})
_GLOB_CHARS = frozenset("*?[")

#: A fraction of ``limit`` in (0, 1].
Fraction = Annotated[float, Field(gt=0, le=1)]
Threshold = Fraction
#: A strict integer limit: ``true`` or ``"1000"`` are refused, not coerced.
Limit = Annotated[int, Field(strict=True, gt=0, le=MAX_AMOUNT)]


def _match_schema(schema: dict[str, Any]) -> None:
    # pydantic renders a constrained key as ``patternProperties``, which lets any other
    # key through; state it as ``propertyNames`` so the schema refuses unknown fields.
    for pattern, values in schema.pop("patternProperties", {}).items():
        schema["propertyNames"] = {**schema.get("propertyNames", {}), "pattern": pattern}
        schema["additionalProperties"] = values


class Burst(BaseModel):
    """A token bucket beside the window: at most ``capacity`` of the policy's unit at once,
    refilled at ``rate`` per ``per`` (see ``schemas.burst``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate: Limit = Field(description="Tokens added per `per`, in the policy's unit.")
    per: Duration = Field("1s", description="The refill period: at most 24h.")
    capacity: Limit = Field(
        description="The bucket's size, and how full it starts: a request for more never "
        "fits. `capacity` x `per` (in ms) must stay within 2**53 - 1."
    )

    @property
    def per_ms(self) -> int:
        """The refill period in milliseconds."""
        return parse_duration_ms(self.per)

    @field_validator("per")
    @classmethod
    def _per_range(cls, value: str) -> str:
        if parse_duration_ms(value) > _MAX_TTL_MS:
            raise ValueError(f"per {value} must be at most 24h")
        return value

    @model_validator(mode="after")
    def _exact(self) -> Self:
        # The Lua twin keeps the level as capacity * per_ms in a double: exact to 2**53.
        if self.capacity * self.per_ms > MAX_AMOUNT:
            raise ValueError(
                f"capacity: {self.capacity} x per {self.per} exceeds 2**53 - 1; "
                "use a shorter per or a smaller capacity"
            )
        return self

    def spec(self) -> BurstSpec:
        """The engine's view of this bucket."""
        return BurstSpec(self.rate, self.per_ms, self.capacity)


class Policy(BaseModel):
    """One budget rule: no more than ``limit`` ``unit`` in any trailing ``window``.

    Every refusal names the field: single-field rules are field validators (the field is
    the error's ``loc``); rules across fields raise with the field name as the message
    prefix (``bucket: ...``, ``downgrade_to: ...``). Rules that need the price catalog
    live in :func:`validate_against_catalog`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: PolicyId = Field(
        description="The policy's name: 1 to 64 of `a-z`, `0-9`, `.`, `_` and `-`. Applying "
        "a policy with an id in force replaces that policy."
    )
    match: dict[SubjectFieldName, SubjectValue] = Field(
        default_factory=dict,
        json_schema_extra=_match_schema,
        description="Which requests the policy counts: subject field -> exact value or glob "
        "(`*`, `?`, `[...]`); every entry must match. `{}` matches every request. A secret "
        "field (`api_key` by default) takes an exact value or `*`, never a glob.",
    )
    group_by: list[SubjectFieldName] = Field(
        default_factory=list,
        description="Subject fields whose values split the policy into budget keys, one "
        "counter per combination (`[tenant]`: one per tenant); `[]`: one counter for every "
        "matching request. Unique.",
    )
    unit: Unit = Field(
        description="What is counted: `requests`, `input_tokens`, `output_tokens`, "
        "`total_tokens` (input + output, and cached input unless `count_cached_input` is "
        "false), `cost_usd` (micro-dollars) or `gpu_seconds` (milli-GPU-seconds)."
    )
    limit: Limit = Field(
        description="The most of `unit` any trailing `window` may hold: a whole number from 1 "
        'to 2**53 - 1 (`true` or `"1000"` are refused, not coerced).'
    )
    window: Duration = Field(
        "24h", description="The trailing window's length, 30s to 31d (`30s`, `1h`, `7d`)."
    )
    bucket: Duration = Field(
        "1m",
        description="Width of the buckets the window is kept in: whole seconds that divide "
        "`window`. A window total is off by at most one bucket's usage (see `boundary`).",
    )
    boundary: Boundary = Field(
        "include",
        description="How the oldest bucket, partly inside the window, counts: `include` in "
        "full (never under-counts), `exclude` not at all (never over-counts), `prorate` by "
        "its overlap.",
    )
    mode: Mode = Field(
        "enforce",
        description="`enforce` refuses; `observe` never refuses: the answer is 200 "
        "`observe_reject`, saying what would have happened, and the usage still counts.",
    )
    on_exceed: OnExceed = Field(
        "reject",
        description="What a refusal does: `reject` (429 with `Retry-After`), `cap` (admit with "
        "a smaller `max_output_tokens`), `downgrade` (re-check as the model `downgrade_to`), "
        "`route` (re-check on the pool `route_to`) or `delay` (hold the request until it "
        "fits, up to `max_delay`).",
    )
    downgrade_to: SubjectValue | None = Field(
        None,
        description="The model a refused request is re-checked as: required exactly when "
        "`on_exceed` is `downgrade`; one model (not a glob) with a price in the catalog.",
    )
    route_to: SubjectValue | None = Field(
        None,
        description="The pool a refused request is re-checked on: required exactly when "
        "`on_exceed` is `route`; one pool, not a glob.",
    )
    max_delay: Duration | None = Field(
        None,
        description="The longest `delay` holds a request: only with `on_exceed: delay`; at "
        "most 60s (none: 5s).",
    )
    burst: Burst | None = Field(
        None,
        description="A token bucket beside the window, on the same budget key and unit: a "
        "request needs room in both (none: no bucket).",
    )
    alerts: list[Threshold] = Field(
        default_factory=lambda: [0.5, 0.8, 1.0],
        description="Shares of `limit` (in (0, 1], ascending, unique) whose crossing "
        "publishes an alert, once per crossing; it re-arms when usage falls back under.",
    )
    overage: OverageMode = Field(
        "record",
        description="A commit above everything its reservation held is charged in full and "
        "alerted either way: `record` does only that; `cap_next` also scales the key's next "
        "estimates by the observed ratio (at most 16x), decaying back to 1 over one window.",
    )
    failure: FailureMode = Field(
        "closed",
        description="How the policy decides when its window cannot be trusted (Redis "
        "unreachable, or the worker's mark missing or stale): `closed` refuses (503), `open` "
        "admits, `degraded` admits within `degraded_allowance` per admission process.",
    )
    degraded_allowance: Fraction = Field(
        0.1,
        description="With `failure: degraded`, the share of `limit` (in (0, 1]) one admission "
        "process may admit per budget key while the window cannot be trusted.",
    )
    reservation_ttl: Duration = Field(
        "15m",
        description="How long an unsettled reservation is held before it is charged at its "
        "estimate and a `reservation_expired` alert is sent: 1s to 24h.",
    )
    count_cached_input: StrictBool = Field(
        True, description="Whether cached input tokens count in `total_tokens`."
    )
    unpriced: Unpriced = Field(
        "reject",
        description="A `cost_usd` policy meeting a model with no price: `reject` refuses the "
        "request (422 naming the model), `charge_default` charges the catalog's `default`.",
    )
    forecast: Duration | None = Field(
        None,
        description="Alert (kind `forecast`) when the key is predicted to exhaust within "
        "this horizon at its recent burn rate; at most `window` (none: no forecast alerts).",
    )

    @property
    def window_ms(self) -> int:
        """The trailing window in milliseconds."""
        return parse_duration_ms(self.window)

    @property
    def bucket_ms(self) -> int:
        """The bucket width in milliseconds."""
        return parse_duration_ms(self.bucket)

    @property
    def forecast_ms(self) -> int:
        """The forecast alert's horizon in milliseconds (0: no forecast alerts)."""
        return parse_duration_ms(self.forecast) if self.forecast is not None else 0

    @property
    def reservation_ttl_ms(self) -> int:
        """How long an unfinished reservation is held before it is charged in full."""
        return parse_duration_ms(self.reservation_ttl)

    @field_validator("window")
    @classmethod
    def _window_range(cls, value: str) -> str:
        if not _MIN_WINDOW_MS <= parse_duration_ms(value) <= MAX_WINDOW_MS:
            raise ValueError(f"window {value} is outside 30s..31d")
        return value

    @field_validator("bucket")
    @classmethod
    def _whole_seconds(cls, value: str) -> str:
        if parse_duration_ms(value) % 1000:
            raise ValueError(f"bucket {value} must be a whole number of seconds")
        return value

    @field_validator("reservation_ttl")
    @classmethod
    def _ttl_range(cls, value: str) -> str:
        if not _MIN_TTL_MS <= parse_duration_ms(value) <= _MAX_TTL_MS:
            raise ValueError(f"reservation_ttl {value} must be between 1s and 24h")
        return value

    @field_validator("group_by")
    @classmethod
    def _unique_fields(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("group_by fields must be unique")
        return value

    @field_validator("alerts")
    @classmethod
    def _sorted_thresholds(cls, value: list[float]) -> list[float]:
        if value != sorted(set(value)):
            raise ValueError("alerts thresholds must be sorted ascending and unique")
        return value

    @field_validator("downgrade_to")
    @classmethod
    def _concrete_model(cls, value: str | None) -> str | None:
        if value is not None and _GLOB_CHARS.intersection(value):
            raise ValueError(f"downgrade_to {value!r} must name one model, not a glob")
        return value

    @field_validator("route_to")
    @classmethod
    def _concrete_pool(cls, value: str | None) -> str | None:
        if value is not None and _GLOB_CHARS.intersection(value):
            raise ValueError(f"route_to {value!r} must name one pool, not a glob")
        return value

    @field_validator("max_delay")
    @classmethod
    def _delay_range(cls, value: str | None) -> str | None:
        if value is not None and parse_duration_ms(value) > _MAX_DELAY_MS:
            raise ValueError(f"max_delay {value} must be at most 60s (a request is held open)")
        return value

    @property
    def max_delay_ms(self) -> int:
        """How long ``delay`` holds a request (default 5 s)."""
        return parse_duration_ms(self.max_delay) if self.max_delay is not None else 5_000

    @model_validator(mode="after")
    def _check(self) -> Self:
        window_ms, bucket_ms = self.window_ms, self.bucket_ms
        if bucket_ms > window_ms or window_ms % bucket_ms:
            raise ValueError(f"bucket: {self.bucket} must divide window {self.window}")
        if self.forecast is not None and not 0 < self.forecast_ms <= window_ms:
            raise ValueError(
                f"forecast: {self.forecast} must be positive and at most the window "
                f"{self.window} (the projection looks one window ahead)"
            )
        if (self.on_exceed == "downgrade") != (self.downgrade_to is not None):
            raise ValueError("downgrade_to: required exactly when on_exceed is 'downgrade'")
        if (self.on_exceed == "route") != (self.route_to is not None):
            raise ValueError("route_to: required exactly when on_exceed is 'route'")
        if self.max_delay is not None and self.on_exceed not in _DELAYING:
            raise ValueError("max_delay: only with on_exceed 'delay'")
        return self


def validate_against_catalog(policy: Policy, catalog: PriceCatalog) -> None:
    """Check the rules of ``policy`` that depend on the price catalog.

    The policy model cannot see the catalog, so apply-time code calls this for every
    policy once both are known.

    Args:
        policy: a validated policy.
        catalog: the price catalog in force.

    Raises:
        PolicyError: ``downgrade_to`` names a model with no price (the catalog default
            does not count), or ``unpriced`` is ``charge_default`` while the catalog has
            no ``default``. The message starts with the field name.
    """
    if policy.downgrade_to is not None and catalog.price_of(policy.downgrade_to) is None:
        raise PolicyError(
            f"downgrade_to: policy {policy.id!r} downgrades to {policy.downgrade_to!r}, "
            "which has no price in the catalog"
        )
    if policy.unpriced == "charge_default" and catalog.default is None:
        raise PolicyError(
            f"unpriced: policy {policy.id!r} is 'charge_default' but the price catalog "
            "has no default"
        )
