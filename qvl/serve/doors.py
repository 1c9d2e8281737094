"""Who may knock: the API key a request sends, and with --api-key but no --auth a guard in front of every door.

Without --auth, Gradio's page and API (`ask`, uploads, files, the MCP tool) have no login, so a key that guarded only
the OpenAI API would leave the rest open. The guard asks every request for the key instead; a browser, which cannot
send one, is told that the page needs --auth. With --auth, Gradio's login guards its own doors (the MCP server,
which is outside it, is refused with --auth) and the OpenAI API takes each login as a key.
"""
import logging
import secrets

from starlette.middleware import Middleware
from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse
from starlette.websockets import WebSocketClose

from qvl import settings, texts

log = logging.getLogger("qvl")
OWN_CHECK = "/v1/"  # the OpenAI API checks the key itself, refusing in OpenAI's format
# launch() asks this, without a key, before it returns: it runs Gradio's start-up once and then only answers false.
START_UP = "/gradio_api/startup-events"


def sent(headers) -> bytes:
    """The key a request sends as 'Authorization: Bearer KEY'; empty without one."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    return key.strip().encode() if scheme.lower() == "bearer" else b""


def matching(given: bytes, keys: list[str]) -> str | None:
    """The key among keys that given is, compared in constant time (so timing says nothing of a key); else None."""
    found = [key for key in keys if secrets.compare_digest(given, key.encode())]
    return found[0] if found else None


class KeyGuard:
    """ASGI middleware: a request without the key gets a 401 that says how to get in, in its language."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"].startswith(OWN_CHECK) or \
                scope["path"] == START_UP or matching(sent(HTTPConnection(scope).headers), [self.key]):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await WebSocketClose(code=1008)(scope, receive, send)  # 1008: policy violation
        lang = texts.language(HTTPConnection(scope))
        refusal = PlainTextResponse(f"{texts.say(lang, 'api_key')}\n\n{texts.say(lang, 'page_needs_auth')}\n",
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await refusal(scope, receive, send)


def guard(config: settings.Settings) -> list[Middleware]:
    """launch()'s app_kwargs middleware: the KeyGuard with --api-key and no --auth, else none."""
    if not config.api_key or config.auth:
        return []
    log.info("--api-key without --auth: every request needs the key, the page's too; add --auth to offer the page "
             "to visitors")
    return [Middleware(KeyGuard, key=config.api_key)]
