"""The server's API key: what a key may be, which hosts are safe without one, and the middleware that asks for it.
No web framework is needed to check a key (the CLI checks ``--api-key`` before loading anything)."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Callable

from lookahead.api import APIError


def check_api_key(key: str) -> str:
    """``key`` if a client can send it in an ``Authorization`` header (visible ASCII, no spaces), else a ValueError:
    an empty key would otherwise look like protection while matching nothing, or everything."""
    if not key:
        raise ValueError("the API key is empty")
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise ValueError("the API key must be printable ASCII without spaces (clients send it in an HTTP header)")
    return key


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (where serving without an API key is safe enough)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve to any interface
        return False


class RequireKey:
    """ASGI middleware: without ``Authorization: Bearer <key>`` a request gets 401 before anything reads its body,
    parses it or queues it (so an unauthenticated client costs no more than the header check); ``/health`` stays
    open for load balancers and probes. ``deny(path, error, code, headers)`` makes the 401 response."""

    OPEN = frozenset({"/health"})

    def __init__(self, app, key: bytes, deny: Callable) -> None:
        self.app, self.key, self.deny = app, key, deny

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool | None:
        """True: the right key; False: a wrong one (or another scheme); None: no Authorization header."""
        values = [v for k, v in headers if k == b"authorization"]
        if not values:
            return None
        scheme, _, token = values[0].strip().partition(b" ")
        right = hmac.compare_digest(token.strip(), self.key)  # constant time: timing shows at most the length
        return right and scheme.lower() == b"bearer" and len(values) == 1

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        verdict = self.authorized(scope["headers"])
        if verdict:
            return await self.app(scope, receive, send)
        message = ("missing API key: send it as 'Authorization: Bearer <key>'" if verdict is None else
                   "invalid API key: send the server's key as 'Authorization: Bearer <key>'")
        response = self.deny(scope["path"], APIError(401, message), "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
