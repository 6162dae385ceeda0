"""ServerLimits validation, the connection table and the send-error log filter (pure)."""

import argparse
import logging

import pytest

from serving import RepeatedLineFilter, ServerLimits, add_limit_arguments, limits_from_args
from serving.limited_protocol import ConnectionTable
from serving.quiet_log import SEND_ERROR_MESSAGE, install_quiet_logging


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
    log_filter = RepeatedLineFilter(SEND_ERROR_MESSAGE, "write(s) to disconnected clients",
                                    interval_s=60.0, clock=lambda: now[0])
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


def test_quiet_logging_covers_send_errors_and_invalid_requests():
    sends, invalid = install_quiet_logging()
    try:
        assert sends in logging.getLogger("asyncio").filters
        assert invalid in logging.getLogger("uvicorn.error").filters
        record = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1,
                                   "Invalid HTTP request received.", None, None)
        assert invalid.filter(record) and "1 invalid HTTP request(s)" in record.getMessage()
        assert not invalid.filter(logging.LogRecord("uvicorn.error", logging.WARNING, __file__,
                                                    1, "Invalid HTTP request received.", None,
                                                    None))
    finally:
        logging.getLogger("asyncio").removeFilter(sends)
        logging.getLogger("uvicorn.error").removeFilter(invalid)


def test_the_protocol_base_is_uvicorns_choice():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from serving.limited_protocol import limited_protocol_class

    table = ConnectionTable(ServerLimits())
    assert issubclass(limited_protocol_class(table, "h11"), H11Protocol)
    try:
        import httptools  # noqa: F401
    except ImportError:
        assert issubclass(limited_protocol_class(table, "auto"), H11Protocol)
    with pytest.raises(ValueError, match="http must be"):
        limited_protocol_class(table, "h2")
