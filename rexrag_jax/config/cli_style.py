"""One command-line convention for every `rexrag` sub-command.

Flags are declared once, in either spelling; `conventional(parser)` makes every `--long_name` also answer
to `--long-name` and the other way round (the help lists the declared spelling only), and the help of
every flag shows its default. Sub-commands call it on their parser before parsing.
"""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Raw descriptions, "(default: X)" after each help unless it already names its default, and only the
    declared spelling of each flag."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not text or "default" in text.lower() or action.default in (None, argparse.SUPPRESS, [])
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            return text
        return super()._get_help_string(action)

    def _format_action_invocation(self, action):
        aliases = getattr(action, "_style_aliases", ())
        if not aliases:
            return super()._format_action_invocation(action)
        declared = [s for s in action.option_strings if s not in aliases]
        saved, action.option_strings = action.option_strings, declared
        try:
            return super()._format_action_invocation(action)
        finally:
            action.option_strings = saved


def _other_spelling(flag: str) -> str | None:
    if not flag.startswith("--") or len(flag) <= 3:
        return None
    body = flag[2:]
    alt = body.replace("_", "-") if "_" in body else body.replace("-", "_")
    return None if alt == body else "--" + alt


def conventional(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the other spelling of every long flag as an alias and show defaults in the help; returns parser."""
    parser.formatter_class = HelpFormatter
    for action in list(parser._actions):
        for flag in list(action.option_strings):
            alt = _other_spelling(flag)
            if alt and alt not in parser._option_string_actions:
                action.option_strings.append(alt)
                action._style_aliases = (*getattr(action, "_style_aliases", ()), alt)
                parser._option_string_actions[alt] = action
    return parser
