"""HTTP fetching for the downloader: one shared connection pool, bounded in every dimension.

A :class:`Fetcher` is shared by the threads that download one shard. Every request is bounded: a
timeout (connect, each socket read, and the whole attempt: every read of the status line, headers
and body ends by the attempt's deadline, so a server sending a byte at a time cannot hold a thread
past it), a maximum body size (read as a stream and
abandoned past the limit), a bounded number of redirects that may never leave http/https. Only
timeouts and 5xx answers are retried, with exponential backoff; a 404 will not change on a retry.
Failures raise :class:`FetchError` whose ``reason`` is a short code counted in the stats: ``timeout``
only for a server that did not answer in time; a refused connection is ``connection_refused``, a host
name that does not resolve ``dns_error``, any other failure to connect or read ``connection_error``.
Its text, ``"reason: detail"``, is a row's ``error_message`` and a key of its shard's ``status_dict``,
so the detail never repeats the row's own URL (the row has it): one 404 reads like every other.
"""

from __future__ import annotations

import dataclasses
import io
import socket
import threading
import time
import urllib.parse

import urllib3

USER_AGENT = "sd-pretrain-downloader/0.1"
ALLOWED_SCHEMES = ("http", "https")
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_CHUNK = 64 * 1024


@dataclasses.dataclass(frozen=True)
class FetchConfig:
    timeout: float = 10.0  # seconds: connect, each read, and the whole attempt
    retries: int = 2  # extra attempts, on timeouts and 5xx only
    backoff: float = 0.5  # seconds before the first retry, doubled for each next one
    max_bytes: int = 20 * 2**20  # larger bodies fail as "too_large"
    max_redirects: int = 5
    user_agent: str = USER_AGENT


class FetchError(Exception):
    """A failed download or validation; ``reason`` is a stable short code, ``detail`` says more."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


class _Retryable(Exception):
    """Wraps a FetchError that a later attempt may not repeat (timeout, 5xx)."""

    def __init__(self, error: FetchError):
        super().__init__(str(error))
        self.error = error


def check_scheme(url: str, reason: str = "unsupported_scheme", referrer: str | None = None) -> None:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme.lower() not in ALLOWED_SCHEMES or not parsed.netloc:
        if referrer:  # a redirect's target is news (the row has the URL it came from): name it
            raise FetchError(reason, f"redirected to {url!r}: only http and https URLs are fetched")
        what = f"scheme {parsed.scheme!r}" if parsed.scheme else "no scheme"
        raise FetchError(reason, f"{what}: only http and https URLs are fetched")


def connect_failure(error: Exception) -> str:
    """The reason code of a connection that could not be made (urllib3's NewConnectionError; a connect
    that timed out is a ConnectTimeoutError of its own): ``connection_refused`` (nothing listens at
    that port), ``dns_error`` (the host name does not resolve), or ``connection_error`` (unreachable
    network, reset, ...)."""
    if isinstance(error, urllib3.exceptions.NameResolutionError):
        return "dns_error"
    causes, seen = [error], set()
    while causes:
        cause = causes.pop()
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, ConnectionRefusedError):
            return "connection_refused"
        causes += [cause.__cause__, cause.__context__]
    if "Connection refused" in str(error):
        return "connection_refused"
    return "connection_error"


# ---- the whole-attempt deadline, on every read -----------------------------------------------------
# A socket timeout bounds one read; a server that sends a byte a second never trips it, in the headers
# or the body. So each read of a connection's socket gets as timeout what is left of its thread's
# attempt (the connection is used by one thread at a time), and none once nothing is left.

_ATTEMPT = threading.local()  # .deadline: time.monotonic() by which this thread's attempt must end


class _DeadlineSocket:
    """A connected socket whose reads end by the deadline of the attempt of the thread reading it."""

    def __init__(self, sock):
        self._sock = sock

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def _arm(self) -> None:
        deadline = getattr(_ATTEMPT, "deadline", None)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the attempt's deadline passed")
            self._sock.settimeout(left)

    def recv(self, *args):
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args):
        self._arm()
        return self._sock.recv_into(*args)

    def makefile(self, mode="r", buffering=None, **kwargs):
        """What http.client reads the status line, headers and body through: reads via :meth:`recv_into`."""
        if mode != "rb":
            return self._sock.makefile(mode, buffering, **kwargs)
        raw = socket.SocketIO(self, "rb")
        self._sock._io_refs += 1  # as socket.makefile counts it: the socket closes when its files do
        return io.BufferedReader(raw, io.DEFAULT_BUFFER_SIZE if buffering in (None, -1, 0) else buffering)


class _HTTPConnection(urllib3.connection.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock = _DeadlineSocket(self.sock)


class _HTTPSConnection(urllib3.connection.HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        self.sock = _DeadlineSocket(self.sock)


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class Fetcher:
    """Downloads URLs through one urllib3 pool; safe to share between threads."""

    def __init__(self, config: FetchConfig = FetchConfig(), pool_size: int = 16):
        self.config = config
        # Redirects and retries are handled here, not by urllib3, to check schemes and count hops.
        self.http = urllib3.PoolManager(
            num_pools=max(64, pool_size), maxsize=pool_size, block=False, retries=False,
            timeout=urllib3.Timeout(connect=config.timeout, read=config.timeout),
            headers={"User-Agent": config.user_agent, "Accept": "image/*,*/*;q=0.5"})
        self.http.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}

    def fetch(self, url: str) -> bytes:
        """The body of ``url`` after redirects; raises FetchError."""
        if not isinstance(url, str) or not url.strip():
            raise FetchError("invalid_url", "empty or not text")
        url = url.strip()
        check_scheme(url)
        attempts = self.config.retries + 1
        for attempt in range(attempts):
            try:
                return self._follow(url)
            except _Retryable as retryable:
                if attempt + 1 == attempts:
                    raise retryable.error from None
                time.sleep(self.config.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _follow(self, url: str) -> bytes:
        deadline = _ATTEMPT.deadline = time.monotonic() + self.config.timeout
        try:
            return self._follow_until(url, deadline)
        finally:
            _ATTEMPT.deadline = None

    def _follow_until(self, url: str, deadline: float) -> bytes:
        for _ in range(self.config.max_redirects + 1):
            response = self._request(url)
            body = None
            try:
                if response.status in REDIRECT_STATUSES:
                    location = response.headers.get("Location")
                    if not location:
                        raise FetchError(f"http_{response.status}", "redirect without a Location header")
                    target = urllib.parse.urljoin(url, location)
                    check_scheme(target, reason="redirect_scheme", referrer=url)
                    url = target
                    continue
                if response.status >= 500:
                    raise _Retryable(FetchError(f"http_{response.status}", response.reason or ""))
                if not 200 <= response.status < 300:
                    raise FetchError(f"http_{response.status}", response.reason or "")
                body = self._read_body(response, deadline)
                return body
            finally:
                if body is None:  # close rather than drain: an unread body may be huge or endless
                    response.close()
                response.release_conn()  # a fully read connection goes back to the pool for reuse
        raise FetchError("too_many_redirects", f"more than {self.config.max_redirects}")

    def _request(self, url: str) -> urllib3.BaseHTTPResponse:
        try:
            return self.http.request("GET", url, preload_content=False, redirect=False)
        except urllib3.exceptions.NewConnectionError as e:
            # Caught before TimeoutError: urllib3 2 makes every failed connect a ConnectTimeoutError
            # subclass, a refused connection or an unknown host included.
            raise FetchError(connect_failure(e), type(e).__name__) from None
        except urllib3.exceptions.TimeoutError as e:
            raise _Retryable(FetchError("timeout", type(e).__name__)) from None
        except urllib3.exceptions.LocationValueError as e:
            raise FetchError("invalid_url", str(e)) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise FetchError("connection_error", type(e).__name__) from None

    def _read_body(self, response: urllib3.BaseHTTPResponse, deadline: float) -> bytes:
        limit = self.config.max_bytes
        declared = response.headers.get("Content-Length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise FetchError("too_large", f"more than {limit} bytes (Content-Length)")
        body = bytearray()
        try:
            for chunk in response.stream(_CHUNK):
                body += chunk
                if len(body) > limit:
                    raise FetchError("too_large", f"more than {limit} bytes")
                if time.monotonic() > deadline:  # a trickling server can dodge the per-read timeout
                    raise _Retryable(FetchError("timeout", f"body not received within {self.config.timeout} s"))
        except urllib3.exceptions.TimeoutError:
            raise _Retryable(FetchError("timeout", "body read timed out")) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise FetchError("connection_error", f"body: {type(e).__name__}") from None
        return bytes(body)
