"""The subcommands of ``aphrodite``, one module each.

A module here is a subcommand when it defines::

    def add_parser(subparsers) -> argparse.ArgumentParser   # adds and returns its parser
    def run(args: argparse.Namespace) -> int                 # the exit status

The command line finds the modules of this package by name (no list to edit), so a new subcommand
is one new file. Modules are imported on every start of ``aphrodite``: import heavy dependencies
inside ``run``.
"""
