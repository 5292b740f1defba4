"""The operator dashboard (``spendgate dashboard``): budgets, refusals and alerts, read-only."""

from __future__ import annotations

from dashboard.settings import DashboardSettings

__all__ = ["DashboardSettings"]
