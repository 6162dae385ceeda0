"""ServerLimits validation, the connection table and the send-error log filter (pure)."""

import argparse
import logging

import pytest

from serving import SendErrorLogFilter, ServerLimits, add_limit_arguments, limits_from_args
from serving.disconnect_log import SEND_ERROR_MESSAGE
from serving.limited_protocol import ConnectionTable


@pytest.mark.parametrize("kwargs", [
    {"header_timeout_s": 0}, {"body_timeout_s": -1.0}, {"keep_alive_timeout_s": float("inf")},
    {"header_timeout_s": "5"}, {"max_connections": -1}, {"max_connections_per_client": 1.5},
    {"max_connections": True},
])
def test_bad_limits_are_clear_errors(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ServerLimits(**kwargs)


def test_cli_flags_build_the_limits():
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    assert limits_from_args(parser.parse_args([])) == ServerLimits()
    args = parser.parse_args(["--header-timeout-s", "2", "--max-connections-per-client", "0"])
    assert limits_from_args(args) == ServerLimits(header_timeout_s=2.0,
                                                  max_connections_per_client=0)


def test_table_caps_per_client_and_in_total():
    closed = []
    table = ConnectionTable(ServerLimits(max_connections=3, max_connections_per_client=2),
                            on_close=closed.append)
    assert table.try_open("a") and table.try_open("a")
    assert not table.try_open("a")  # per client
    assert table.try_open("b")
    assert not table.try_open("c")  # in total
    assert closed == ["over_capacity", "over_capacity"]
    assert table.num_open == 3 and dict(table.num_open_by_client) == {"a": 2, "b": 1}
    table.release("a")
    assert table.try_open("c")
    for client in ("a", "b", "c"):
        table.release(client)
    assert table.num_open == 0 and not table.num_open_by_client


def test_zero_means_no_cap():
    table = ConnectionTable(ServerLimits(max_connections=0, max_connections_per_client=0))
    assert all(table.try_open("a") for _ in range(10_000))


def _record(msg):
    return logging.LogRecord("asyncio", logging.WARNING, __file__, 1, msg, None, None)


def test_send_errors_become_one_line_per_interval():
    now = [100.0]
    log_filter = SendErrorLogFilter(interval_s=60.0, clock=lambda: now[0])
    assert log_filter.filter(_record("something else"))
    first = _record(SEND_ERROR_MESSAGE)
    assert log_filter.filter(first)  # the first one says what is going on
    assert "1 write(s) to disconnected clients" in first.getMessage()
    passed = []
    for _ in range(3000):
        now[0] += 0.01  # 30 s of them
        passed.append(log_filter.filter(_record(SEND_ERROR_MESSAGE)))
    assert not any(passed)
    now[0] += 31.0
    summary = _record(SEND_ERROR_MESSAGE)
    assert log_filter.filter(summary)
    assert summary.getMessage().startswith("3001 write(s)") and "(3002 in all)" in \
        summary.getMessage()
    assert log_filter.num_total == 3002
