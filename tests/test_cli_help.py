"""Every flag of every ``kvguard`` subcommand and ``kvguard bench`` target has help text (shown
with its default by ``--help``): the test walks the parsers the CLI builds."""

import argparse
import importlib

import pytest

from chaos.bench.cli import TARGETS
from guard.cli import SUBCOMMANDS

MODULES = sorted({module for module, _ in SUBCOMMANDS.values()}
                 | {module for module, _ in TARGETS.values()} | {"chaos.bench.engine_prefix"})


def _undocumented(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    """The flags and positionals of ``parser`` (its sub-commands' included) without help."""
    missing = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if not action.help or action.help == argparse.SUPPRESS:
            missing.append(prefix + ("/".join(action.option_strings) or action.dest))
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _undocumented(sub, f"{prefix}{name} ")
    return missing


def undocumented(module_name: str) -> list[str]:
    parser = argparse.ArgumentParser()
    importlib.import_module(module_name).configure(parser)
    return _undocumented(parser)


@pytest.mark.parametrize("module_name", MODULES)
def test_every_flag_has_help(module_name):
    assert undocumented(module_name) == []
