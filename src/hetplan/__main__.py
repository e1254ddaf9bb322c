"""Allows ``python -m hetplan``."""

from hetplan.cli import main

main()
