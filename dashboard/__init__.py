"""The operator dashboard (``spendgate dashboard``): budgets, refusals and alerts, read-only."""

from __future__ import annotations

from spendgate.dashboard.settings import DashboardSettings

__all__ = ["DashboardSettings"]
