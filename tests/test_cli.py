"""Every ``kvguard`` subcommand the help lists is real: its module imports and has the hooks."""

import argparse
import importlib
import subprocess
import sys

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


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("kvguard ") and out.strip() != "kvguard"


def test_help_names_the_extra_each_subcommand_needs(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "serve one engine replica (OpenAI-compatible HTTP) [needs kvguard[engine]]" in out
    assert "[needs" not in out.split("the standalone proxy in front of N replicas")[1][:20]


@pytest.mark.parametrize("name,blocked,extra", [("engine", "torch", "engine"),
                                                ("plan", "torch", "engine"),
                                                ("load", "matplotlib", "bench"),
                                                ("chaos", "matplotlib", "bench")])
def test_a_subcommand_without_its_extra_names_it_in_one_line(name, blocked, extra):
    """A guard-only install: the subcommand's dependency is missing (blocked here by a None in
    sys.modules, which makes its import fail as an absent package does)."""
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            "from guard.cli import main\n"
            f"sys.exit(main([{name!r}, '--help']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"kvguard[{extra}]" in lines[0] and blocked in lines[0]


def test_subcommand_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    assert "(default:" in capsys.readouterr().out


@pytest.mark.parametrize("front_end", [["proxy", "--upstream", "http://127.0.0.1:9"],
                                       ["engine", "--model", "tiny", "--backend", "sim"]])
def test_every_front_end_reports_a_bad_config_in_one_line(front_end, tmp_path):
    """The same bad file through the proxy and the engine's --guard: one line naming the key,
    exit 2, no traceback (the engine reads it before its server starts)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("policy = 3\n")
    flag = "--config" if front_end[0] == "proxy" else "--guard"
    done = subprocess.run([sys.executable, "-m", "guard.cli", *front_end, flag, str(bad),
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"kvguard {front_end[0]}: error: policy: expected str, got int 3"], done.stderr
