"""Why a stream URL gave no frame, asked of its server: OpenCV says only that opening failed, while the server
answers in words (the name does not resolve, the connection is refused, an error status). HTTP(S) and RTSP are
spoken; for other schemes the port is only connected to.
"""

from __future__ import annotations

import http.client
import socket
import time
import urllib.parse

# The port a scheme's server listens on when the URL names none.
_DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322, "http": 80, "https": 443, "rtmp": 1935}


def stream_failure(url: str, started: float, timeout_s: float) -> str:
    """Why a stream URL gave no frame, for its error message. OpenCV says only that it failed; asking the
    server ourselves finds the reason (the name does not resolve, the connection is refused, the server
    answers an error status), and the time it took says whether it failed at once or timed out."""
    elapsed = time.monotonic() - started
    reason = ask_stream_server(url, min(timeout_s, 5.0))
    if reason is not None:
        return f"{reason} (after {elapsed:.1f} s)"
    if elapsed >= 0.9 * timeout_s:
        return f"nothing decodable arrived within {timeout_s:g} s"
    return f"the stream ended after {elapsed:.1f} s without a frame OpenCV's FFmpeg could decode (--verbose shows its log)"


def ask_stream_server(url: str, timeout_s: float) -> str | None:
    """The server's side of a failed stream, in words, or None when it seems to serve (the stream's
    content is then what fails). Speaks HTTP(S) and RTSP; for other schemes only connects."""
    parts = urllib.parse.urlsplit(url)
    scheme, host = parts.scheme.lower(), parts.hostname
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        return f"its port is not a number ({parts.netloc})"
    if host is None or port is None:
        return None
    address = f"{host}:{port}"
    try:
        if scheme in ("http", "https"):
            return _http_status(parts, host, port, timeout_s)
        with socket.create_connection((host, port), timeout=timeout_s) as connection:
            if scheme != "rtsp":
                return None
            connection.settimeout(timeout_s)
            connection.sendall(f"DESCRIBE {url} RTSP/1.0\r\nCSeq: 1\r\nAccept: application/sdp\r\n\r\n".encode())
            status = connection.makefile("rb").readline(256).decode("latin-1").strip()
        return _status_problem(status, address)
    except socket.gaierror as error:
        return f"the host name {host} does not resolve ({error.strerror})"
    except ConnectionRefusedError:
        return f"{address} refused the connection (no server listens there)"
    except TimeoutError:
        return f"{address} did not answer within {timeout_s:g} s"
    except (OSError, http.client.HTTPException) as error:
        return f"talking to {address} failed: {getattr(error, 'strerror', None) or error or type(error).__name__}"


def _http_status(parts: urllib.parse.SplitResult, host: str, port: int, timeout_s: float) -> str | None:
    kind = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    connection = kind(host, port, timeout=timeout_s)
    try:
        connection.request("GET", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")))
        response = connection.getresponse()  # the status and headers only: a live stream never ends
        status = f"HTTP/{response.version / 10:.1f} {response.status} {response.reason}"
        return _status_problem(status, f"{host}:{port}")
    except http.client.RemoteDisconnected:
        return f"{host}:{port} closed the connection without answering"
    finally:
        connection.close()


def _status_problem(status: str, address: str) -> str | None:
    """An answer's status line as a reason, or None for a success (2xx)."""
    if not status:
        return f"{address} closed the connection without answering"
    fields = status.split(" ", 2)
    if len(fields) >= 2 and fields[1].isdigit() and fields[1].startswith("2"):
        return None
    return f"the server answered {status!r}"
