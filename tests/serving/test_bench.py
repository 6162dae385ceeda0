"""``kvguard bench serving`` runs end to end at a tiny size and prints every ratio."""

from guard.cli import main


def test_bench_serving_smoke(capsys):
    assert main(["bench", "serving", "--requests", "20", "--block", "10"]) == 0
    out = capsys.readouterr().out
    assert out.count("limited / plain request rate:") == 2
    assert out.count("kvguard / plain request rate:") == 2
