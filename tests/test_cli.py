"""Every ``kvguard`` subcommand the help lists is real: its module imports and has the hooks."""

import argparse
import importlib

import pytest

from guard.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_module_builds_its_parser(name):
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"kvguard {name}")
    module.configure(parser)
    assert callable(module.run)
    assert parser.format_help()


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_help_names_its_own_folder_and_only_its_own_flags():
    module = importlib.import_module(SUBCOMMANDS["demo"][0])
    parser = argparse.ArgumentParser(prog="kvguard demo")
    module.configure(parser)
    text = parser.format_help()
    assert "runs/demo-<time>" in text and "overload" not in text
    for flag in ("--loads", "--policies", "--sweep", "--capacity"):  # the bake-off's, not demo's
        assert flag not in text


def test_demo_load_is_refused_where_it_would_do_nothing_or_nonsense(capsys):
    assert main(["demo", "--scenario", "seed", "--load", "2"]) == 2
    assert "--load applies to the single-replica demo only" in capsys.readouterr().err
    assert main(["demo", "--load", "0"]) == 2
    assert "--load must be > 0" in capsys.readouterr().err
