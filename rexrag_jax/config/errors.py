"""Errors that mean "bad input found at start": the commands print them as one line and exit 2.

Defined in the lowest layer so that `rexrag train` (train/main.py) can catch what an upper layer's
trainer raises while it is built (e.g. rapo's static trace buffer checks) without importing it.
"""


class StartupInputError(ValueError):
    """A file, directory or setting that does not match what the run expects; the message is one line
    naming the file/field and what was expected."""
