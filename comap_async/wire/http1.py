"""A lean HTTP/1.1 keep-alive client on an asyncio ``Protocol``, for plain ``http://`` inference endpoints.

Why: actors send 4-5 completions per environment step. aiohttp's ``ClientSession`` request
machinery measured ~345 us of CPU per request on this machine; through this module
``InferenceClient`` spent 103-140 us (3 KB prompt, uvloop; 311-346 us over aiohttp in the same
runs). Protocol callbacks (no StreamReader/StreamWriter, no task per request, the timeout a
``call_at`` timer) and one write per request keep it lean.

Supports: per-endpoint pools of idle keep-alive connections (``http://host[:port][/prefix]``),
one request in flight per connection, bodies by ``Content-Length``, chunked transfer coding
(extensions and trailers ignored) or read-until-close, interim 1xx skipped, a transparent retry
on a fresh connection when a reused idle one was closed by the server before any response byte
(keep-alive timeouts: uvicorn/vLLM close idle connections after 5 s).
Refuses (:class:`HttpProtocolError`): TLS (use aiohttp for ``https://``), 101 upgrades, content
codings (it asks for ``identity``), header blocks over 64 KiB, bodies over 256 MiB, malformed
status lines, headers, lengths or chunks.
"""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024
MAX_BODY = 256 * 1024 * 1024
_HEX = frozenset(b"0123456789abcdefABCDEF")
_HEAD, _LENGTH, _SIZE, _DATA, _TRAILER, _CLOSE, _DONE = range(7)


class HttpProtocolError(ConnectionError):
    """The server's response is not HTTP/1.x this client can read; the connection is dropped."""


class ResponseParser:
    """Incremental response parser, no I/O: ``feed`` chunks (True once complete), ``feed_eof`` at close."""

    def __init__(self, head_request: bool = False, max_body: int = MAX_BODY) -> None:
        self.status, self.reason, self.version, self.headers = 0, "", "", {}
        self.body, self.keep_alive, self.done, self.leftover = b"", False, False, b""
        self._buf, self._parts = bytearray(), bytearray()
        self._state, self._need, self._trailer_bytes = _HEAD, 0, 0
        self._head_request, self._max_body = head_request, max_body

    def feed(self, data: bytes) -> bool:
        if self._state == _HEAD and not self._buf:  # the usual case, a whole response in one read: no copies
            i = data.find(b"\r\n\r\n")
            if 0 <= i <= MAX_HEAD:
                self._parse_head(data[:i].decode("latin-1"))
                end = i + 4 + self._need
                if self._state == _LENGTH and len(data) >= end:
                    self.body, self.leftover, self._state, self.done = data[i + 4 : end], data[end:], _DONE, True
                    return True
                data = data[i + 4 :]
        buf = self._buf
        buf += data
        while True:
            state = self._state
            if state == _HEAD:
                i = buf.find(b"\r\n\r\n")
                if i < 0 or i > MAX_HEAD:
                    if len(buf) > MAX_HEAD:
                        raise HttpProtocolError(f"response header block exceeds {MAX_HEAD} bytes")
                    return False
                self._parse_head(buf[:i].decode("latin-1"))
                del buf[: i + 4]
            elif state == _LENGTH:
                if len(buf) < self._need:
                    return False
                self.body = bytes(buf[: self._need])
                del buf[: self._need]
                self._state = _DONE
            elif state == _SIZE or state == _TRAILER:
                i = buf.find(b"\r\n")
                self._trailer_bytes += (i + 2) if state == _TRAILER else 0
                if (len(buf) if i < 0 else self._trailer_bytes) > MAX_HEAD:
                    raise HttpProtocolError(f"chunk-size line or trailers exceed {MAX_HEAD} bytes")
                if i < 0:
                    return False
                line = bytes(buf[:i])
                del buf[: i + 2]
                if state == _SIZE:
                    self._chunk_size(line)
                elif not line:  # trailers carry nothing this client uses: skipped, only their size bounded
                    self.body, self._state = bytes(self._parts), _DONE
            elif state == _DATA:
                end = self._need
                if len(buf) < end + 2:
                    return False
                if buf[end : end + 2] != b"\r\n":
                    raise HttpProtocolError("chunk data not followed by CRLF")
                self._parts += buf[:end]
                del buf[: end + 2]
                self._state = _SIZE
            elif state == _CLOSE:
                self._parts += buf
                buf.clear()
                if len(self._parts) > self._max_body:
                    raise HttpProtocolError(f"response body exceeds {self._max_body} bytes")
                return False
            else:
                self.done, self.leftover = True, bytes(buf)
                return True

    def feed_eof(self) -> bool:
        """The server closed: True when that completes the response, else :class:`HttpProtocolError`."""
        if self._state == _CLOSE:
            self.body, self._state, self.done = bytes(self._parts), _DONE, True
        if self.done:
            return True
        what = (
            "without sending a response"
            if self._state == _HEAD and not self._buf
            else "before the response was complete"
        )
        raise HttpProtocolError(f"server closed the connection {what}")

    def _parse_head(self, head: str) -> None:
        lines = head.split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        if (
            len(version) != 8
            or not version.startswith("HTTP/1.")
            or version[7] not in "0123456789"
            or len(code) != 3
            or not code.isascii()
            or not code.isdigit()
        ):
            raise HttpProtocolError(f"malformed status line {lines[0][:100]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        name = ""
        for line in lines[1:]:
            if line[:1] in (" ", "\t") and name:  # obsolete line folding: RFC 9112 says replace with a space
                headers[name] += " " + line.strip(" \t")
                continue
            key, sep, value = line.partition(":")
            if not sep or not key or " " in key or "\t" in key:
                raise HttpProtocolError(f"malformed header line {line[:100]!r}")
            name, value = key.lower(), value.strip(" \t")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if status < 200:
            if status == 101 or status < 100:
                raise HttpProtocolError(f"unsupported status {status} (no upgrades, no 0xx)")
            return  # interim response (100 Continue, 103 Early Hints): the real one follows
        self.status, self.reason, self.version, self.headers = status, reason, version, headers
        connection = headers.get("connection")
        if connection is None:
            self.keep_alive = version != "HTTP/1.0"
        else:
            tokens = {t.strip() for t in connection.lower().split(",")}
            self.keep_alive = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
        coding = headers.get("content-encoding")
        if coding is not None and coding.lower() not in ("identity", ""):
            raise HttpProtocolError(f"unsupported Content-Encoding {coding!r} (identity was asked for)")
        te, cl = headers.get("transfer-encoding"), headers.get("content-length")
        if self._head_request or status == 204 or status == 304:
            self._state = _DONE
        elif te is not None:
            if te.lower().rsplit(",", 1)[-1].strip() == "chunked":
                self._state = _SIZE
                self.keep_alive = self.keep_alive and cl is None  # both set: RFC 9112 6.1 says close after
            else:
                self._state, self.keep_alive = _CLOSE, False
        elif cl is not None:
            n = cl if cl.isdigit() else ",".join({v.strip() for v in cl.split(",")})  # "5, 5" is one length
            if not (n.isascii() and n.isdigit()):
                raise HttpProtocolError(f"bad Content-Length {cl!r}")
            self._need = int(n)
            if self._need > self._max_body:
                raise HttpProtocolError(f"Content-Length {self._need} exceeds the {self._max_body}-byte limit")
            self._state = _LENGTH
        else:
            self._state, self.keep_alive = _CLOSE, False

    def _chunk_size(self, line: bytes) -> None:
        size = line.split(b";", 1)[0].strip(b" \t")
        if not size or len(size) > 16 or not _HEX.issuperset(size):
            raise HttpProtocolError(f"malformed chunk-size line {line[:100]!r}")
        n = int(size, 16)
        if len(self._parts) + n > self._max_body:
            raise HttpProtocolError(f"response body exceeds {self._max_body} bytes")
        self._need, self._state = n, (_DATA if n else _TRAILER)


class _Endpoint:
    """``http://host[:port][/prefix]`` parsed once, with its idle and all its open connections."""

    __slots__ = ("host", "port", "prefix", "host_header", "idle", "conns")

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname or u.username or u.password or u.query or u.fragment:
            raise ValueError(f"{url!r}: the keep-alive client takes http://host[:port][/prefix] only")
        self.host, self.port, self.prefix, self.host_header = u.hostname, u.port or 80, u.path.rstrip("/"), u.netloc
        self.idle: list[_Conn] = []
        self.conns: set[_Conn] = set()

    def take(self) -> "_Conn | None":
        while self.idle:
            conn = self.idle.pop()  # the most recently used: the least likely to have hit the server's idle timeout
            if not conn.transport.is_closing():
                return conn
        return None


class _Conn(asyncio.Protocol):
    """One connection, at most one request in flight; ``waiter`` gets ``(status, body)`` or the error."""

    def __init__(self, ep: _Endpoint) -> None:
        self.ep, self.transport, self.parser, self.waiter = ep, None, None, None
        self.got_bytes = self.reusable = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # one small write per request: Nagle would hold it for the peer's delayed ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ep.conns.add(self)

    def send(self, data: bytes, head_request: bool, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        self.parser, self.waiter = ResponseParser(head_request), loop.create_future()
        self.got_bytes = self.reusable = False
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # bytes nobody asked for: the stream is out of step, so it cannot be reused
            self.transport.abort()
            return
        self.got_bytes = True
        try:
            done = parser.feed(data)
        except HttpProtocolError as exc:
            self.parser = None
            self.transport.abort()
            if not self.waiter.done():
                self.waiter.set_exception(exc)
            return
        if done:
            self.parser, self.reusable = None, parser.keep_alive and not parser.leftover
            if not self.waiter.done():  # a timed-out request has no one waiting
                self.waiter.set_result((parser.status, parser.body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.ep.conns.discard(self)
        if self in self.ep.idle:
            self.ep.idle.remove(self)
        parser, self.parser = self.parser, None
        if parser is not None and not self.waiter.done():
            try:
                parser.feed_eof()
                self.waiter.set_result((parser.status, parser.body))  # a read-until-close body
            except HttpProtocolError as err:
                self.waiter.set_exception(err if exc is None else ConnectionError(f"{err}: {exc}"))

    def time_out(self, timeout_s: float) -> None:
        if not self.waiter.done():
            self.waiter.set_exception(asyncio.TimeoutError(f"timed out after {timeout_s:g} s waiting for the response"))
            self.transport.abort()


class Http1Pool:
    """Keep-alive connections per endpoint; no limit on their number (aiohttp's ``limit=0`` before)."""

    def __init__(self) -> None:
        self._eps: dict[str, _Endpoint] = {}

    async def request(
        self,
        endpoint: str,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout_s: float,
        connect_timeout_s: float,
    ) -> tuple[int, bytes]:
        """``(status, body)``; raises ``ConnectionError`` (incl. :class:`HttpProtocolError`) or ``TimeoutError``."""
        ep = self._eps.get(endpoint)
        if ep is None:
            ep = self._eps[endpoint] = _Endpoint(endpoint)
        extra = ""
        for key, value in headers.items():
            if "\r" in key or "\n" in key or "\r" in value or "\n" in value:
                raise ValueError(f"header {key!r}: CR/LF would split the request")
            extra += f"{key}: {value}\r\n"
        if path[:1] != "/" or " " in path or "\r" in path or "\n" in path:
            raise ValueError(f"bad request path {path!r}")
        head = f"{method} {ep.prefix}{path} HTTP/1.1\r\nHost: {ep.host_header}\r\nAccept-Encoding: identity\r\n"
        if body is None:
            data = f"{head}{extra}\r\n".encode("latin-1")
        else:
            data = (
                f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode("latin-1")
                + body
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        conn = ep.take()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(ep, loop, min(connect_timeout_s, deadline - loop.time()))
            waiter = conn.send(data, method == "HEAD", loop)
            timer = loop.call_at(deadline, conn.time_out, timeout_s)
            try:
                status, payload = await waiter
            except ConnectionError:
                conn.transport.abort()
                if reused and not conn.got_bytes:
                    # the server closed this idle connection as we reused it (its keep-alive timeout):
                    # no response byte, so it did not answer; a fresh connection gets one more try
                    reused, conn = False, None
                    continue
                raise
            except BaseException:
                conn.transport.abort()  # cancelled or timed out mid-exchange: the stream's state is unknown
                raise
            finally:
                timer.cancel()
            if conn.reusable and not conn.transport.is_closing():
                ep.idle.append(conn)
            else:
                conn.transport.close()
            return status, payload

    @staticmethod
    async def _connect(ep: _Endpoint, loop: asyncio.AbstractEventLoop, timeout_s: float) -> _Conn:
        if timeout_s <= 0:
            raise asyncio.TimeoutError(f"no time left to connect to {ep.host}:{ep.port}")
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Conn(ep), ep.host, ep.port), timeout_s)
        except asyncio.TimeoutError:  # before OSError: TimeoutError is one
            raise asyncio.TimeoutError(f"connecting to {ep.host}:{ep.port} timed out after {timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectionError(f"cannot connect to {ep.host}:{ep.port}: {exc}") from exc
        return conn

    async def close(self) -> None:
        """Close every connection (requests in flight fail with ``ConnectionError``); the pool stays usable."""
        for ep in self._eps.values():
            ep.idle.clear()
            for conn in list(ep.conns):
                conn.transport.close()
        await asyncio.sleep(0)  # let connection_lost run before the caller may close the loop
