"""The order in which the xdist workers get the suite's files (tests/support/file_order.py)."""

from itertools import pairwise

from tests.support.file_order import FileMarks, file_order

FAST = FileMarks(num_tests=10)


def slow(n: int = 3) -> FileMarks:
    return FileMarks(num_tests=n, slow=True)


def heavy(n: int = 3) -> FileMarks:
    return FileMarks(num_tests=n, heavy=True, slow=True)


def test_exclusive_files_come_first_most_tests_first():
    files = {"a_fast": FAST, "b_slow": slow(), "c_short_chaos": FileMarks(2, exclusive=True,
                                                                         heavy=True, slow=True),
             "d_heavy": heavy(), "e_chaos": FileMarks(14, exclusive=True, heavy=True)}
    assert file_order(files)[:2] == ["e_chaos", "c_short_chaos"]


def test_each_heavy_file_is_followed_by_its_share_of_the_slow_files():
    files = {"fast1": FAST, "h1": heavy(), "s1": slow(), "s2": slow(), "h2": heavy(),
             "s3": slow(), "s4": slow(), "s5": slow(), "h3": FileMarks(1, heavy=True),
             "fast2": FAST}
    # 5 slow files for 3 heavy ones: one each, the rest after the last heavy one
    assert file_order(files) == ["h1", "s1", "h2", "s2", "h3", "s3", "s4", "s5",
                                 "fast1", "fast2"]


def test_no_two_heavy_files_are_adjacent_while_slow_files_last():
    files = {f"h{i}": heavy() for i in range(4)} | {f"s{i}": slow() for i in range(9)}
    order = file_order(files)
    assert [f for f in order if f.startswith("h")] == ["h0", "h1", "h2", "h3"]  # natural order
    assert not any(a.startswith("h") and b.startswith("h") for a, b in pairwise(order))


def test_more_heavy_files_than_slow_ones_and_none_at_all():
    files = {"h1": heavy(), "s1": slow(), "h2": heavy(), "h3": heavy(), "f": FAST}
    assert file_order(files) == ["h1", "s1", "h2", "h3", "f"]
    assert file_order({"f1": FAST, "s1": slow(), "f2": FAST}) == ["s1", "f1", "f2"]
    assert file_order({}) == []


def test_every_file_is_handed_out_exactly_once():
    files = {"x": FileMarks(2, exclusive=True), "h": heavy(), "s": slow(), "f": FAST,
             "hs": FileMarks(5, heavy=True), "s2": slow()}
    order = file_order(files)
    assert sorted(order) == sorted(files)
