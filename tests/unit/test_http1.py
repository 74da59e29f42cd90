"""The keep-alive client's response parser, fed bytes directly (no sockets) in arbitrary splits."""

from __future__ import annotations

import pytest

from comap_async.wire.http1 import MAX_HEAD, HttpProtocolError, ResponseParser


def feed_split(raw: bytes, cuts: list[int], **kw) -> ResponseParser:
    """Feed ``raw`` cut at ``cuts``; complete exactly at the last piece (never earlier)."""
    p = ResponseParser(**kw)
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
    for i, piece in enumerate(pieces):
        done = p.feed(piece)
        assert done == (i == len(pieces) - 1), f"complete={done} after piece {i} of {len(pieces)}"
    return p


CL = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n{"text": "hi\\n"}!'


def test_content_length_body_at_every_split():
    for cut in range(1, len(CL)):
        p = feed_split(CL, [cut])
        assert (p.status, p.reason, p.body, p.keep_alive) == (200, "OK", b'{"text": "hi\\n"}!', True)
        assert p.headers["content-type"] == "application/json"
    p = feed_split(CL, list(range(1, len(CL))))  # one byte at a time
    assert p.body == b'{"text": "hi\\n"}!'


def test_headers_are_case_insensitive_and_repeated_ones_joined():
    p = feed_split(b"HTTP/1.1 200 OK\r\ncOnTeNt-LeNgTh:2\r\nX-A: 1\r\nx-a:  2 \r\n\r\nok", [])
    assert p.headers["x-a"] == "1, 2" and p.body == b"ok"


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;name=value\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n0;last\r\nX-Trailer: t\r\nX-Other: u\r\n\r\n"
)


def test_chunked_with_extensions_and_trailers_at_every_split():
    for cut in range(1, len(CHUNKED)):
        for second in (cut + 1, cut + 7):
            cuts = [c for c in (cut, second) if c < len(CHUNKED)]
            p = feed_split(CHUNKED, cuts)
            assert p.body == b"hello" + b"x" * 26 and p.keep_alive


def test_chunked_with_content_length_is_not_reused():
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n2\r\nab\r\n0\r\n\r\n"
    p = feed_split(raw, [])
    assert p.body == b"ab" and not p.keep_alive


def test_body_until_close():
    p = ResponseParser()
    assert not p.feed(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ")
    assert not p.feed(b"part two")
    assert p.feed_eof() and p.body == b"part one, part two" and not p.keep_alive


def test_no_body_statuses_and_head():
    for status in (204, 304):
        p = feed_split(f"HTTP/1.1 {status} X\r\nContent-Length: 10\r\n\r\n".encode(), [])
        assert p.status == status and p.body == b"" and p.keep_alive
    p = feed_split(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", [], head_request=True)
    assert p.body == b""


def test_interim_100_continue_is_skipped():
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + CL
    for cut in (10, 26, 30, 60, len(raw) - 1):
        p = feed_split(raw, [cut])
        assert p.status == 200 and p.body.endswith(b"!") and "link" not in p.headers


def test_keep_alive_rules():
    def ka(head: bytes) -> bool:
        return feed_split(head + b"Content-Length: 0\r\n\r\n", []).keep_alive

    assert ka(b"HTTP/1.1 200 OK\r\n")
    assert not ka(b"HTTP/1.1 200 OK\r\nConnection: close\r\n")
    assert not ka(b"HTTP/1.1 200 OK\r\nConnection: Upgrade, Close\r\n")
    assert not ka(b"HTTP/1.0 200 OK\r\n")
    assert ka(b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\n")


def test_bytes_after_the_response_are_kept_apart():
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1")
    assert p.body == b"ok" and p.leftover == b"HTTP/1.1"


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"HTTP/2 200 OK\r\n\r\n", "malformed status line"),
        (b"ICY 200 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "bad Content-Length '-5'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 12abc\r\n\r\n", "bad Content-Length '12abc'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3, 4\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999999999999\r\n\r\n", "exceeds"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk-size line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", "not followed by CRLF"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 1\r\n\r\nx", "Content-Encoding"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n", "unsupported status 101"),
    ],
)
def test_malformed_responses_raise_with_a_useful_message(raw, message):
    with pytest.raises(HttpProtocolError, match=message.replace("(", r"\(")):
        ResponseParser().feed(raw)


def test_oversized_header_block_and_body():
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(HttpProtocolError, match="header block exceeds"):
        for _ in range(MAX_HEAD // 1000 + 2):
            p.feed(b"X-Pad: " + b"a" * 991 + b"\r\n")
    with pytest.raises(HttpProtocolError, match="exceeds the 10-byte limit"):
        ResponseParser(max_body=10).feed(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n")
    with pytest.raises(HttpProtocolError, match="body exceeds 10 bytes"):
        ResponseParser(max_body=10).feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nabcdef\r\n6\r\n")
    p = ResponseParser(max_body=10)
    p.feed(b"HTTP/1.1 200 OK\r\n\r\n12345")
    with pytest.raises(HttpProtocolError, match="body exceeds 10 bytes"):
        p.feed(b"678901")


def test_truncated_responses_say_so():
    with pytest.raises(HttpProtocolError, match="without sending a response"):
        ResponseParser().feed_eof()
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    with pytest.raises(HttpProtocolError, match="before the response was complete"):
        p.feed_eof()
