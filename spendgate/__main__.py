"""``python -m spendgate`` runs the command line."""

from __future__ import annotations

from spendgate.cli import main

main()
