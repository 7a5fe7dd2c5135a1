"""aiohttp's answers, read against remote_answers' bounds: the response class of the sessions
behind http(s):// (fsspec's HTTP file system) and gs:// (gcsfs).

fsspec and gcsfs read every answer whole (`await response.read()`, `.text()`, `.json()`):
a listing page, a ranged download, an error page. With this class as the session's
`response_class`, that one read is the bounded one, whoever calls it, and the session asks
for unencoded answers; aiohttp itself follows at most MAX_REDIRECTS redirects, to http(s)
URLs only (others are its redirect errors, which remote_errors classifies).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from ckptfix.io.remote_answers import IDENTITY, new_body


class BoundedResponse(aiohttp.ClientResponse):
    """An answer whose `read()` stops at its bound (remote_answers.new_body)."""

    answer_seconds = 600.0  # set per session by `session_options`

    async def read(self) -> bytes:
        if self._body is None:
            try:
                asked = self.request_info.headers.get("Range")
                body = new_body(asked, self.status, self.headers, self.answer_seconds)
                while chunk := await self.content.read(body.room()):
                    body.add(chunk)
            except BaseException:
                self.close()  # the rest of the body is never read
                raise
            self._body = body.data()
        return await super().read()


def session_options(answer_seconds: float) -> dict[str, Any]:
    """Keyword arguments for an aiohttp.ClientSession whose answers are bounded and
    unencoded, each within `answer_seconds` (a ranged one, and a second per
    remote_answers.MIN_RATE bytes asked)."""
    bounded = type("Answer", (BoundedResponse,), {"answer_seconds": answer_seconds})
    return {"response_class": bounded, "headers": dict(IDENTITY)}
