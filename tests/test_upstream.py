"""common/http_client.py: the pooled HTTP/1.1 client of the gateway and the replay, against real sockets.

Each test starts a small asyncio TCP server that answers with exactly the bytes the test wants
(Content-Length, chunked, close-delimited, Connection: close, a keep-alive socket the server
closes while idle, no answer at all), so every parsing and pooling branch meets a real peer.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from common.http_client import UpstreamConnectError, UpstreamPool, UpstreamTimeout


class Server:
    """Reads one request at a time (head + Content-Length body) and runs ``answer(conn_no, req_no, body)``,
    which returns the bytes to write, or None to write nothing; ``close_after`` closes the socket."""

    def __init__(self, answer, close_after=lambda c, r: False):
        self.answer, self.close_after = answer, close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_no = self.connections
        self.connections += 1
        req_no = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                out = self.answer(conn_no, req_no, body)
                if out is not None:
                    writer.write(out)
                    await writer.drain()
                if self.close_after(conn_no, req_no):
                    writer.close()
                    return
                req_no += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body


def run(coro):
    return asyncio.run(coro)


def test_content_length_answers_reuse_one_connection_and_send_the_body():
    async def main():
        async with Server(lambda c, r, body: ok(b'{"echo":' + body + b"}")) as srv:
            pool = UpstreamPool(srv.url)
            got = [await pool.post("/v1/recommend", b'{"n":%d}' % i, timeout_s=5) for i in range(5)]
            await pool.close()
            return srv, got

    srv, got = run(main())
    assert got == [(200, b'{"echo":{"n":%d}}' % i) for i in range(5)]
    assert srv.connections == 1  # keep-alive
    head = srv.requests[0].split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"post /v1/recommend http/1.1") and b"content-type: application/json" in head


def test_extra_headers_are_sent_and_a_header_that_could_split_the_request_is_refused():
    async def main():
        async with Server(lambda c, r, body: ok(b"{}")) as srv:
            pool = UpstreamPool(srv.url)
            got = await pool.post("/v1/recommend", b"{}", timeout_s=5, headers={"x-racer-load-phase": "burst[4-6s]"})
            refused = []
            for headers in ({"x-a": "one\r\nx-b: two"}, {"x a": "v"}, {"x-a:": "v"}, {"x-a": "v\n"}):
                with pytest.raises(ValueError, match="a name must be a token and a value one line"):
                    await pool.post("/v1/recommend", b"{}", timeout_s=5, headers=headers)
                refused.append(headers)
            await pool.close()
            return srv, got, refused

    srv, got, refused = run(main())
    assert got == (200, b"{}") and len(refused) == 4
    assert len(srv.requests) == 1  # nothing of a refused request reached the server
    assert b"\r\nx-racer-load-phase: burst[4-6s]\r\n" in srv.requests[0]


def test_chunked_interim_and_close_delimited_answers_are_parsed():
    chunked = (b"HTTP/1.1 100 Continue\r\n\r\n"
               b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n")

    async def main():
        async with Server(lambda c, r, b: chunked) as srv:
            pool = UpstreamPool(srv.url)
            a = await pool.post("/x", b"{}", timeout_s=5)
            b = await pool.post("/x", b"{}", timeout_s=5)
            await pool.close()
        async with Server(lambda c, r, b: b"HTTP/1.1 200 OK\r\n\r\nuntil the end", close_after=lambda c, r: True) as srv:
            pool = UpstreamPool(srv.url)
            c = await pool.post("/x", b"{}", timeout_s=5)
            await pool.close()
        return a, b, c

    a, b, c = run(main())
    assert a == (503, b"hello, world") and b == a
    assert c == (200, b"until the end")


def test_connection_close_answer_is_not_reused():
    async def main():
        async with Server(lambda c, r, b: ok(b"1", b"Connection: close\r\n"), close_after=lambda c, r: True) as srv:
            pool = UpstreamPool(srv.url)
            got = [await pool.post("/x", b"{}", timeout_s=5) for _ in range(3)]
            await pool.close()
            return srv.connections, got

    conns, got = run(main())
    assert got == [(200, b"1")] * 3 and conns == 3


def test_a_stale_keep_alive_socket_is_retried_once_on_a_fresh_connection():
    # the server answers the first request, then closes that idle connection (a keep-alive
    # timeout); the pool's next request meets the closed socket and must go out again on a new one
    async def main():
        async with Server(lambda c, r, b: ok(b"conn%d" % c), close_after=lambda c, r: True) as srv:
            pool = UpstreamPool(srv.url)
            first = await pool.post("/x", b"{}", timeout_s=5)
            await asyncio.sleep(0.1)  # the server's close arrives: the pooled connection is closed
            second = await pool.post("/x", b"{}", timeout_s=5)
            await pool.close()
            return first, second, srv.connections

    first, second, conns = run(main())
    assert first == (200, b"conn0") and second == (200, b"conn1") and conns == 2

    # the race itself: the server takes the second request on the kept-alive socket and closes it
    # without answering (its keep-alive timer fired as the bytes arrived); nothing was answered,
    # so the pool sends it once more on a fresh connection
    async def race():
        async with Server(lambda c, r, b: None if (c, r) == (0, 1) else ok(b"conn%d" % c),
                          close_after=lambda c, r: (c, r) == (0, 1)) as srv:
            pool = UpstreamPool(srv.url)
            got = [await pool.post("/x", b"{}", timeout_s=5) for _ in range(3)]
            await pool.close()
            return got, srv.connections, len(srv.requests)

    got, conns, sent = run(race())
    assert got == [(200, b"conn0"), (200, b"conn1"), (200, b"conn1")] and conns == 2 and sent == 4


def test_a_reset_before_the_answer_on_a_fresh_connection_is_an_error_not_a_retry():
    async def main():
        async with Server(lambda c, r, b: None, close_after=lambda c, r: True) as srv:
            pool = UpstreamPool(srv.url)
            with pytest.raises(UpstreamConnectError, match="closed by the node"):
                await pool.post("/x", b"{}", timeout_s=5)
            await pool.close()
            return srv.connections

    assert run(main()) == 1


def test_no_answer_times_out_and_the_connection_is_dropped():
    async def main():
        async with Server(lambda c, r, b: None if c == 0 else ok(b"late-safe")) as srv:
            pool = UpstreamPool(srv.url)
            with pytest.raises(UpstreamTimeout, match="no answer within 0.2 s"):
                await pool.post("/x", b"{}", timeout_s=0.2)
            got = await pool.post("/x", b"{}", timeout_s=5)  # a new connection, not the timed-out one
            await pool.close()
            return got, srv.connections

    got, conns = run(main())
    assert got == (200, b"late-safe") and conns == 2


def test_refused_connection_and_garbage_answers_are_connect_errors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused

    async def main():
        pool = UpstreamPool(f"http://127.0.0.1:{port}")
        with pytest.raises(UpstreamConnectError, match="connect to 127.0.0.1"):
            await pool.post("/x", b"{}", timeout_s=1)
        async with Server(lambda c, r, b: b"SSH-2.0-OpenSSH\r\n\r\n") as srv:
            pool = UpstreamPool(srv.url)
            with pytest.raises(UpstreamConnectError, match="not an HTTP/1.x answer"):
                await pool.post("/x", b"{}", timeout_s=1)
            await pool.close()

    run(main())
    with pytest.raises(ValueError, match="http://host:port"):
        UpstreamPool("https://example.org")


def test_concurrent_requests_are_bounded_by_max_connections():
    async def main():
        async with Server(lambda c, r, b: ok(b)) as srv:
            pool = UpstreamPool(srv.url, max_connections=3)
            got = await asyncio.gather(*(pool.post("/x", b"%d" % i, timeout_s=5) for i in range(20)))
            await pool.close()
            return got, srv.connections

    got, conns = run(main())
    assert sorted(g[1] for g in got) == sorted(b"%d" % i for i in range(20))
    assert conns <= 3


def test_a_chunked_answer_keeps_the_connection_and_an_http_1_0_answer_does_not():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Trailer: t\r\n\r\n"

    async def main(answer):
        async with Server(lambda c, r, b: answer) as srv:
            pool = UpstreamPool(srv.url)
            got = [await pool.post("/x", b"{}", timeout_s=5) for _ in range(3)]
            await pool.close()
            return got, srv.connections

    assert run(main(chunked)) == ([(200, b"ok")] * 3, 1)
    assert run(main(b"HTTP/1.1 204 No Content\r\n\r\n")) == ([(204, b"")] * 3, 1)
    http10 = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"  # no keep-alive: a new connection each
    assert run(main(http10)) == ([(200, b"ok")] * 3, 3)


def test_bytes_after_the_answer_leave_the_answer_and_drop_the_connection():
    async def main():
        async with Server(lambda c, r, b: ok(b"c%d" % c) + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale") as srv:
            pool = UpstreamPool(srv.url)
            got = [await pool.post("/x", b"{}", timeout_s=5) for _ in range(2)]
            await pool.close()
            return got, srv.connections

    assert run(main()) == ([(200, b"c0"), (200, b"c1")], 2)  # the unasked answer never reaches a request


def test_an_oversized_head_or_body_and_a_malformed_answer_are_connect_errors():
    big_head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\nContent-Length: 0\r\n\r\n"
    cases = [
        (big_head, {}, "answer head over 64 KiB"),
        (ok(b"x" * 2000), {"max_body_bytes": 1000}, "answer body of 2000 bytes is over the 1000-byte limit"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"x" * 1024 + b"\r\n" * 2,
         {"max_body_bytes": 1000}, "answer body over the 1000-byte limit"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n", {}, "malformed answer from the node"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", {}, "malformed answer from the node"),
        (b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n", {}, "not an HTTP/1.x answer"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n", {}, "switched protocols"),
    ]

    async def main(answer, kw, match):
        async with Server(lambda c, r, b: answer) as srv:
            pool = UpstreamPool(srv.url, **kw)
            with pytest.raises(UpstreamConnectError, match=match):
                await pool.post("/x", b"{}", timeout_s=5)
            await pool.close()

    for answer, kw, match in cases:
        run(main(answer, kw, match))
    with pytest.raises(ValueError, match="max_body_bytes"):
        UpstreamPool("http://127.0.0.1:1", max_body_bytes=0)


def test_a_head_that_arrives_in_pieces_is_parsed_and_one_that_never_ends_is_cut_at_64_kib():
    class Trickle:
        """Writes ``parts`` one at a time with a pause between them, then keeps the socket open."""

        def __init__(self, parts):
            self.parts = parts

        async def handle(self, reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            for p in self.parts:
                writer.write(p)
                await writer.drain()
                await asyncio.sleep(0.01)
            await asyncio.sleep(1)
            writer.close()

    async def main(parts, expect):
        t = Trickle(parts)
        server = await asyncio.start_server(t.handle, "127.0.0.1", 0)
        pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            if isinstance(expect, str):
                with pytest.raises(UpstreamConnectError, match=expect):
                    await pool.post("/x", b"{}", timeout_s=5)
                return None
            return await pool.post("/x", b"{}", timeout_s=5)
        finally:
            await pool.close()
            server.close()

    answer = ok(b'{"a":1}', b"X-One: 1\r\n")
    assert run(main([answer[i:i + 7] for i in range(0, len(answer), 7)], None)) == (200, b'{"a":1}')
    endless = [b"HTTP/1.1 200 OK\r\n"] + [b"X-Pad: " + b"p" * 8000 + b"\r\n"] * 9
    run(main(endless, "answer head over 64 KiB"))
