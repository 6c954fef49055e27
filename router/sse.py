"""Server-sent-events capture: record a decode stream as it passes through, read it once at the end.

The router forwards D's bytes to the client as they arrive and feeds the same bytes to
:class:`SSECapture`. Per read the capture only appends the bytes to a bounded buffer (C code) and
looks for ``data: [DONE]`` in the new bytes; the whole record is parsed once, when ``[DONE]``
arrives or the stream ends (:func:`kvdiag.router.reply.parse_stream`). A reply longer than the
bound keeps only its last part (enough for the final frame with D's params) and is marked
unreadable, so the reuse rule treats it as unverifiable.

Usage::

    capture = SSECapture()
    async for chunk in response.content.iter_any():
        capture.feed(chunk)
        await client.write(chunk)
    capture.close()
    capture.params           # D's kv_transfer_params, or None
    capture.observed.content # the reply text
"""

from __future__ import annotations

from typing import Any, Final

from kvdiag.router.reply import PARAMS_KEY, Observed, has_done, parse_stream

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "DEFAULT_MAX_RECORD_BYTES", "PARAMS_KEY", "SSECapture", "TokenIdStripper",
           "strip_token_ids"]

DEFAULT_MAX_FRAME_BYTES: Final = 4 << 20
DEFAULT_MAX_RECORD_BYTES: Final = 8 << 20
_DONE: Final = b"[DONE]"


class SSECapture:
    """Records one SSE stream; never raises on bad input, records it instead."""

    __slots__ = ("_buf", "_frame_start", "_max_frame", "_max_record", "_parse", "_scanning", "_truncated",
                 "observed")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, *, chat: bool = True, single_choice: bool = True,
                 token_ids: bool = False) -> None:
        self._buf = bytearray()
        self._parse = (chat, single_choice, token_ids)
        self._frame_start = 0  # where the frame being received starts in the buffer
        self._max_frame = max_frame_bytes
        self._max_record = max(max_record_bytes, 2 * max_frame_bytes)
        self._scanning = True
        self._truncated = False
        self.observed: Observed | None = None  # set once the stream ended ([DONE] or close)

    def feed(self, chunk: bytes) -> None:
        """Record one read of the stream (any size, any split)."""
        if not self._scanning or not chunk:
            return
        buf = self._buf
        start = len(buf)
        buf += chunk
        if len(buf) - self._frame_start > self._max_frame:
            # Only now look for the last frame boundary: a frame longer than the bound is malformed.
            boundary = buf.rfind(b"\n\n", self._frame_start)
            if boundary >= 0:
                self._frame_start = boundary + 2
            if len(buf) - self._frame_start > self._max_frame:
                self._scanning = False
                self._buf = bytearray()
                self.observed = Observed(malformed=f"an SSE frame exceeded {self._max_frame} bytes",
                                         unreadable=True)
                return
            if len(buf) > self._max_record:
                self._roll()
                start = 0
        pos = self._buf.find(_DONE, start - len(_DONE) if start > len(_DONE) else 0)
        if pos >= 0 and has_done(self._buf, pos):
            self._finish()

    def _roll(self) -> None:
        # Keep the last part, cut at a frame boundary: the final frame (D's params) must survive.
        self._truncated = True
        keep = max(self._max_record // 4, self._max_frame)
        cut = self._buf.find(b"\n\n", len(self._buf) - keep)
        if cut < 0:
            return
        del self._buf[:cut + 2]
        self._frame_start = max(self._frame_start - cut - 2, 0)

    def _finish(self) -> None:
        if self.observed is None:
            chat, single, ids = self._parse
            self.observed = parse_stream(bytes(self._buf), chat=chat, single_choice=single, token_ids=ids,
                                         truncated=self._truncated)
        self._scanning = False
        self._buf = bytearray()

    def close(self) -> None:
        """End of stream: parse what was recorded (a final frame without the blank line still counts)."""
        if self.observed is not None:
            return
        if not self._buf.endswith(b"\n\n") and self._buf.strip():
            self._buf += b"\n\n"
        self._finish()

    # The fields the flow reads, None/False until the stream ended.
    @property
    def done(self) -> bool:
        """``data: [DONE]`` was seen."""
        return self.observed is not None and self.observed.done

    @property
    def params(self) -> dict[str, Any] | None:
        """D's kv_transfer_params."""
        return self.observed.params if self.observed is not None else None

    @property
    def params_present(self) -> bool:
        """A frame carried the params key (possibly null)."""
        return self.observed is not None and self.observed.params_present

    @property
    def error(self) -> Any:
        """An error event's payload."""
        return self.observed.error if self.observed is not None else None

    @property
    def finish_reason(self) -> str | None:
        """The last finish reason seen."""
        return self.observed.finish_reason if self.observed is not None else None

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last usage object seen."""
        return self.observed.usage if self.observed is not None else None

    @property
    def malformed(self) -> str | None:
        """Why the stream could not be read, when a frame that matters was broken."""
        return self.observed.malformed if self.observed is not None else None

    @property
    def frames_parsed(self) -> int:
        """Frames parsed as JSON one by one (token frames of vLLM's layout are not)."""
        return self.observed.frames_parsed if self.observed is not None else 0


def strip_token_ids(data: bytes) -> bytes:
    """``token_ids`` / ``prompt_token_ids`` lists replaced by null, as vLLM writes them when not asked.

    Found with C-level searches for the key (a prompt's id list is hundreds of KiB), not a regex scan.
    """
    pos = data.find(b'token_ids":')
    if pos < 0:
        return data
    out: list[bytes] = []
    done = 0
    while pos >= 0:
        key_end = pos + len(b'token_ids":')
        start = key_end + 1 if data[key_end:key_end + 1] == b" " else key_end
        quote = pos - 1 if data[pos - 1:pos] == b'"' else pos - 8  # '"token_ids"' or '"prompt_token_ids"'
        named = data[quote:pos] in (b'"', b'"prompt_')
        end = data.find(b"]", start) if named and data[start:start + 1] == b"[" else -1  # id lists are flat
        if end >= 0:
            out += (data[done:start], b"null")
            done = end + 1
        pos = data.find(b'token_ids":', key_end)
    out.append(data[done:])
    return b"".join(out)


class TokenIdStripper:
    """Removes the token ids the router asked D for from a stream whose client did not ask for them.

    Only whole frames are rewritten (a list may be split across reads); a partial frame waits for
    the next read.
    """

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward for this read."""
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._tail = data
            return b""
        self._tail = data[cut + 2:]
        return strip_token_ids(data[:cut + 2])

    def flush(self) -> bytes:
        """Whatever is left at the end of the stream."""
        rest, self._tail = self._tail, b""
        return strip_token_ids(rest)
