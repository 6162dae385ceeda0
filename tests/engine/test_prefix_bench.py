"""``kvguard bench engine --prefix`` smoke test on the tiny preset (times printed, not asserted)."""

from __future__ import annotations

import argparse
import re

import pytest

from chaos import bench_cli


def test_bench_engine_prefix_runs_through_the_dispatcher(capsys):
    args = argparse.Namespace(target="engine", target_args=[
        "--prefix", "--model", "tiny", "--prompt-tokens", "100", "--prefix-tokens", "70",
        "--repeats", "2"])
    assert bench_cli.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("(64 tokens cached, 36 prefilled)") == 2
    row = re.search(r"\| 100 \| 64 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|", out)
    assert row and all(float(x) > 0 for x in row.groups())


@pytest.mark.parametrize("bad", [["--prefix-tokens", "100"], ["--repeats", "0"],
                                 ["--prompt-tokens", "1"]])
def test_bad_arguments_are_clear_errors(bad):
    args = argparse.Namespace(target="engine", target_args=["--prefix", "--model", "tiny",
                                                            "--prompt-tokens", "100",
                                                            "--prefix-tokens", "70", *bad])
    with pytest.raises(ValueError, match=bad[0]):
        bench_cli.run(args)
