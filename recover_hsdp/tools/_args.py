"""Argument parsing shared by the subcommands that report user error as one line (exit 2)."""
from __future__ import annotations

import argparse


class UsageError(Exception):
    """A user error in the arguments: the subcommand prints it as one line and exits 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UsageError instead of printing usage and exiting."""

    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)
