"""Server-sent-events tail capture: watch a decode stream pass through without slowing it.

The router forwards D's bytes to the client as they arrive and feeds the same bytes to
:class:`SSECapture`. It keeps only the bytes after the last complete frame (frames may be split
across reads), looks for a few markers with a substring search over complete frames, and
``json.loads`` only the frames that contain one: the final chunk with ``kv_transfer_params``
(vLLM PR #40186), a usage chunk, a chunk with a finish reason, an error event, ``[DONE]``.

Usage::

    capture = SSECapture()
    async for chunk in response.content.iter_any():
        await client.write(chunk)
        capture.feed(chunk)
    capture.close()
    capture.params  # D's kv_transfer_params, or None
"""

from __future__ import annotations

import json
from typing import Any, Final

PARAMS_KEY: Final = "kv_transfer_params"
DEFAULT_MAX_FRAME_BYTES: Final = 4 << 20
_MARKERS: Final = (b"[DONE]", b'"finish_reason":"', b'"kv_transfer_params"', b'"error"', b'"usage":{',
                   b'"finish_reason": "', b'"usage": {')


def _marked_frames(block: bytes) -> list[bytes]:
    """The frames of ``block`` (complete frames, LF-separated) that contain a marker, in stream order.

    One C-level ``find`` per marker over the whole read, not one check per frame: a read that carries
    many token frames costs the same as a read that carries one.
    """
    spans: set[tuple[int, int]] = set()
    for marker in _MARKERS:
        pos = block.find(marker)
        while pos >= 0:
            start = block.rfind(b"\n\n", 0, pos)
            start = start + 2 if start >= 0 else 0
            end = block.find(b"\n\n", pos)
            end = end if end >= 0 else len(block)
            spans.add((start, end))
            pos = block.find(marker, end)
    return [block[start:end] for start, end in sorted(spans)]


class SSECapture:
    """Incremental scanner of one SSE stream; never raises on bad input, records it instead."""

    __slots__ = ("_max_frame", "_scanning", "_tail", "done", "error", "finish_reason", "frames_parsed",
                 "malformed", "params", "params_present", "usage")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._tail = b""
        self._max_frame = max_frame_bytes
        self._scanning = True
        self.params: dict[str, Any] | None = None
        self.params_present = False  # a frame carried the key (possibly null)
        self.done = False  # ``data: [DONE]`` seen
        self.error: Any = None  # an error event's payload
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.malformed: str | None = None
        self.frames_parsed = 0

    def feed(self, chunk: bytes) -> None:
        """Scan one read of the stream (any size, any split)."""
        if not self._scanning or not chunk:
            return
        data = self._tail + chunk if self._tail else chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if end == 0:
            self._keep(data)
            return
        complete, self._tail = data[:end], data[end:]
        if len(self._tail) > self._max_frame:
            self._overflow()
            return
        if b"\r" in complete:
            complete = complete.replace(b"\r\n", b"\n")
        for frame in _marked_frames(complete):
            self._parse(frame)

    def _keep(self, data: bytes) -> None:
        if len(data) > self._max_frame:
            self._overflow()
        else:
            self._tail = data

    def _overflow(self) -> None:
        self.malformed = f"an SSE frame exceeded {self._max_frame} bytes"
        self._scanning = False
        self._tail = b""

    def close(self) -> None:
        """End of stream: a final frame without the blank line still counts."""
        if self._scanning and self._tail.strip():
            frame, self._tail = self._tail, b""
            for marked in _marked_frames(frame.replace(b"\r\n", b"\n")):
                self._parse(marked)
        self._scanning = False

    def _parse(self, frame: bytes) -> None:
        payload = b"\n".join(line[5:].lstrip(b" ") for line in frame.split(b"\n") if line.startswith(b"data:"))
        if not payload:
            return  # comments, event:/id: lines only
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        self.frames_parsed += 1
        try:
            obj = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            self.malformed = f"decode stream frame is not JSON ({exc})"
            return
        if not isinstance(obj, dict):
            self.malformed = "decode stream frame is not a JSON object"
            return
        if "error" in obj or obj.get("object") == "error":
            self.error = obj.get("error", obj)
        if PARAMS_KEY in obj:
            value = obj[PARAMS_KEY]
            self.params_present = True
            if isinstance(value, dict):
                self.params = value
            elif value is not None:
                self.malformed = f"{PARAMS_KEY} in the decode stream is not an object"
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                    self.finish_reason = choice["finish_reason"]
