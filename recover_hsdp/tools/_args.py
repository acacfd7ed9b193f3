"""Argument parsing shared by the subcommands that report user error as one line (exit 2)."""
from __future__ import annotations

import argparse


class UsageError(Exception):
    """A user error in the arguments: the subcommand prints it as one line and exits 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UsageError instead of printing usage and exiting."""

    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def subparser_names(parser: argparse.ArgumentParser) -> list[str]:
    """The names of ``parser``'s subcommands (its add_subparsers choices), in their order."""
    return [name for action in parser._actions
            if isinstance(action, argparse._SubParsersAction) for name in action.choices]
