"""The numeric codes ADMIT and EXTEND exchange with Python, each table once.

The Lua side writes these numbers literally (each script's header names the table it
uses); the contract modules decode them here, and a test runs every code on real Redis.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "EXTEND_OUTCOMES",
    "FAILURE_MODES",
    "NEVER_FITS",
    "ON_EXCEED",
    "OUTCOMES",
    "STATES",
    "ExtendOutcome",
    "Outcome",
    "State",
]

Outcome = Literal["reject", "allow", "cap", "observe_reject", "unvouched"]
#: Whether Redis holds a window the worker vouches for (see ``schemas.shards``).
State = Literal["vouched", "stale", "missing"]
ExtendOutcome = Literal["reject", "allow", "unvouched", "missing", "settled"]

#: ADMIT's outcomes (4, "try the alternatives", never leaves the script).
OUTCOMES: dict[int, Outcome] = {
    0: "reject",
    1: "allow",
    2: "cap",
    3: "observe_reject",
    5: "unvouched",
}
#: EXTEND's outcomes.
EXTEND_OUTCOMES: dict[int, ExtendOutcome] = {
    0: "reject",
    1: "allow",
    5: "unvouched",
    6: "missing",
    7: "settled",
}
#: A key's state, by its code (the index).
STATES: tuple[State, ...] = ("vouched", "stale", "missing")
#: A policy's failure mode (what an unvouched window means), as the scripts read it.
FAILURE_MODES = {"closed": 0, "open": 1, "degraded": 2}
#: A policy's ``on_exceed`` as ADMIT reads it: downgrade and route are both "try the
#: alternative"; delay refuses in the script (the waiting is the caller's, admission.delay).
ON_EXCEED = {"reject": 0, "cap": 1, "downgrade": 2, "route": 2, "delay": 0}
#: ADMIT's retry_after_ms when the request can never fit (-1: no wait known).
NEVER_FITS = -2
