"""The budget store's own Redis client: the RESP parser byte by byte, then a real redis-server
(pipelined calls, error replies, a SIGSTOPped server, a killed one, AUTH and SELECT)."""

from __future__ import annotations

import asyncio
import signal

import pytest
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis_servers import RedisServer, free_port

from guard.budget.resp import RespParser, encode_command
from guard.budget.resp_client import RespClient, supports
from tests.support.self_connect import connects_to_itself


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_parser_reassembles_replies_split_at_every_byte():
    stream = (b"+OK\r\n:42\r\n$5\r\nh\xc3\xa9lo\r\n$-1\r\n*3\r\n$1\r\na\r\n:-7\r\n*1\r\n$0\r\n\r\n"
              b"-NOSCRIPT No matching script\r\n*-1\r\n")
    parser = RespParser()
    replies = []
    for i in range(len(stream)):
        parser.feed(stream[i:i + 1])
        replies.extend(parser.replies())
    assert replies[:6] == ["OK", 42, "h\u00e9lo", None, ["a", -7, [""]], replies[5]]
    assert replies[5].message.startswith("NOSCRIPT") and replies[6] is None
    assert len(replies) == 7


def test_parser_rejects_a_stream_that_is_not_resp():
    parser = RespParser()
    parser.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(ValueError, match="protocol error"):
        parser.replies()


def test_commands_encode_as_bulk_strings_and_bad_arguments_are_refused():
    assert encode_command(("EVALSHA", "ab", 1, "k", 2.5, b"\x00")) == (
        b"*6\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n1\r\n$1\r\nk\r\n$3\r\n2.5\r\n$1\r\n\x00\r\n")
    with pytest.raises(TypeError):
        encode_command(("SET", "k", None))
    with pytest.raises(TypeError):
        encode_command(("SET", "k", True))


def test_urls_it_takes_and_those_left_to_redis_py():
    assert supports("redis://127.0.0.1:6379/0") and supports("redis://:pw@host")
    assert not supports("rediss://host:6379/0")
    assert not supports("unix:///tmp/redis.sock")
    assert not supports("redis://host:6379/0?socket_timeout=1")
    client = RespClient.from_url("redis://u:p%40ss@10.0.0.1:6390/3", 0.5)
    assert (client.host, client.port, client.db) == ("10.0.0.1", 6390, 3)
    with pytest.raises(ValueError):
        RespClient.from_url("rediss://host", 0.5)
    with pytest.raises(ValueError):
        RespClient(host="h", port=1, timeout_s=0)


def test_pipelined_calls_get_their_own_replies_and_errors(redis_server):
    async def go():
        client = RespClient.from_url(redis_server.url, 2.0)
        sha = await client.script_load("return ARGV[1] .. KEYS[1]")
        replies = await asyncio.gather(*(client.evalsha(sha, 1, f"k{i}", f"v{i}")
                                         for i in range(200)))
        assert replies == [f"v{i}k{i}" for i in range(200)]
        assert await client.ping()
        assert "redis_version" in await client.info("server")
        with pytest.raises(NoScriptError):
            await client.evalsha("0" * 40, 0)
        with pytest.raises(ResponseError):
            await client.execute("NOSUCHCOMMAND")
        assert await client.ping()  # an error reply leaves the connection usable
        await client.aclose()
        with pytest.raises(RedisConnectionError):
            await client.ping()
    run(go())


def test_a_hung_server_times_out_and_a_killed_one_fails_then_both_reconnect():
    server = RedisServer().start()

    async def go():
        client = RespClient.from_url(server.url, 0.2)
        first_id = await client.execute("CLIENT", "ID")
        server.signal(signal.SIGSTOP)
        try:
            outcomes = await asyncio.gather(*(client.ping() for _ in range(5)),
                                            return_exceptions=True)
            assert all(isinstance(o, (RedisTimeoutError, RedisConnectionError))
                       for o in outcomes)
            assert any(isinstance(o, RedisTimeoutError) for o in outcomes)
        finally:
            server.signal(signal.SIGCONT)
        assert await client.execute("CLIENT", "ID") != first_id  # the timed-out one was dropped
        server.kill()
        with pytest.raises((RedisConnectionError, RedisTimeoutError)):
            await client.ping()
        server.start()  # the same port, killed by the finally below
        assert await client.ping()
        await client.aclose()
    try:
        run(go())
    finally:
        server.kill()


def test_password_and_database_from_the_url():
    server = RedisServer()
    server.port = free_port()
    server.start()
    try:
        server.cli("config", "set", "requirepass", "s3cret")

        async def go():
            client = RespClient.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/2", 2.0)
            await client.execute("SET", "where", "db2")
            await client.aclose()
            refused = RespClient.from_url(f"redis://127.0.0.1:{server.port}/0", 2.0)
            with pytest.raises(AuthenticationError):  # NOAUTH
                await refused.execute("GET", "where")
            await refused.aclose()
        run(go())
        assert server.cli("-a", "s3cret", "-n", "2", "get", "where").strip().endswith("db2")
    finally:
        server.kill()


def test_a_connection_that_reaches_itself_is_refused_and_redis_can_start_on_the_port():
    """Redis is down and the kernel gives the client's connection Redis's port as its own: the
    socket is connected to itself. The client refuses it (it would read its own commands back
    as replies, and hold the port so that Redis could never start again) and closes it."""
    server = RedisServer()  # a free port, not started yet

    async def go():
        client = RespClient.from_url(server.url, 2.0)
        with connects_to_itself(asyncio.get_running_loop(), server.port):
            with pytest.raises(RedisConnectionError, match="reached itself"):
                await client.ping()
        await asyncio.to_thread(server.start)  # the port is free: no socket kept it
        assert await client.ping() is True
        await client.aclose()
    try:
        run(go())
    finally:
        server.kill()
