"""Reading an HTTP request's body against hostile or broken clients (docs/serving.md): a size limit, a budget the
bodies being read at once share, a time limit, and gzip/deflate inflated here.

A body over --max-message-bytes is refused from its Content-Length before a byte is read; when the bodies being
read at once would take more than their budget, at once. A body must arrive within BODY_TIMEOUT_S of its headers.
gzip and deflate bodies are inflated bounded, off the event loop (aiohttp's own inflating runs on the loop, and
goes on inflating a refused body's rest). Refusals are `serving/errors.py` kinds.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from capsnet.serving.errors import InvalidInput, QueueFull, RequestTimeout, TooLarge, UnsupportedEncoding

# A request body must have arrived this long after its headers (a full batch is about 1.7 MB): a client that sends
# it slowly, or never, gets 408 instead of holding its request, and the shutdown waiting for it, without end.
BODY_TIMEOUT_S = 30.0
# Request bodies being read at once hold at most this much memory together (declared sizes; a chunked body counts as
# the limit); a request past it gets 503 at once. 1,000 connections each sending 1.6 MB of a body and stalling took the
# server to 2 GB before.
BODY_BUDGET_BYTES = 128 * 2 ** 20
# Content-Encoding of request bodies, and zlib's wbits for each: gzip's header, and zlib's (HTTP's "deflate").
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class BodyReader:
    """Reads request bodies of at most `limit` bytes (inflated, too), within a budget shared by those being read."""

    def __init__(self, limit: int):
        self.limit = limit
        self._budget = max(BODY_BUDGET_BYTES, limit)
        self._reading_bytes = 0  # declared sizes of the bodies being read

    async def read(self, request: web.Request) -> bytes:
        """The request's body, inflated."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", *ENCODINGS):
            raise UnsupportedEncoding(f"Content-Encoding {encoding[:40]!r} is not taken; send the body as is, or as "
                                      f"{' or '.join(ENCODINGS)}")
        if (request.content_length or 0) > self.limit:
            raise self._too_large()
        reserved = self.limit if request.content_length is None else request.content_length
        if self._reading_bytes + reserved > self._budget:
            raise QueueFull(f"too many request bodies are arriving at once ({self._reading_bytes} bytes of at most "
                            f"{self._budget}); retry shortly, or on another replica")
        self._reading_bytes += reserved
        try:  # all of it, or HTTPRequestEntityTooLarge past the application's client_max_size (a chunked body)
            body = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:  # not TimeoutError: Python 3.10's is another class
            raise RequestTimeout(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s of its "
                                 "headers") from None
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None
        except web.RequestPayloadError as err:  # a malformed chunked body
            raise InvalidInput(f"request body: {err}") from None
        finally:
            self._reading_bytes -= reserved
        if encoding == "identity":
            return body
        inflated = await asyncio.to_thread(_inflate, body, encoding, self.limit)
        if inflated is None:
            raise self._too_large()
        return inflated

    def _too_large(self) -> TooLarge:
        return TooLarge(f"the request body exceeds the server's limit of {self.limit} bytes (--max-message-bytes); "
                        "send fewer images per request, or their data in binary")


def _inflate(body: bytes, encoding: str, limit: int) -> bytes | None:
    """A gzip or deflate body inflated; None when it inflates to more than `limit` bytes (read no further)."""
    inflater = zlib.decompressobj(ENCODINGS[encoding])
    try:
        inflated = inflater.decompress(body, limit + 1)
    except zlib.error as err:
        raise InvalidInput(f"request body: not valid {encoding} data ({err})") from None
    if len(inflated) > limit:
        return None
    if not inflater.eof or inflater.unused_data:
        raise InvalidInput(f"request body: not one complete {encoding} stream")
    return inflated
