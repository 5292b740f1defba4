"""The ``spendgate`` command line and the local development stack."""

from __future__ import annotations

__all__: list[str] = []
