"""Pictures named by a link, as the OpenAI API, the MCP tool and `ask` take them: a data: URL, or an http(s) URL
that is downloaded only with --allow-image-urls and only from public addresses.
"""
import asyncio
import base64
import binascii
import ipaddress
import socket
from pathlib import Path

import httpx

from qvl.conversation import InputError
from qvl.serve.answers import size_text

FETCH_S = 10.0  # a whole image download, redirects included
REDIRECTS = 3


async def read(url: str, field: str, allowed: bool, limit: int) -> bytes:
    """The picture's bytes, at most `limit` of them; `allowed` is --allow-image-urls, field names the link in the
    request (for the message when it is neither kind of link)."""
    if url.startswith("data:"):
        return data_url(url, limit, field)
    if url.startswith(("http://", "https://")):
        if not allowed:
            raise InputError("image_url_off")
        return await fetch(url, limit)
    raise InputError("bad_field", field=field)


def public(address: str) -> bool:
    """Whether an image may be downloaded from this IP address: a global one, not this machine, a private network,
    link-local (cloud metadata services live there) or multicast."""
    ip = ipaddress.ip_address(address.split("%")[0])  # an IPv6 scope (fe80::1%eth0) is not part of the address
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def resolve(host: str, port: int) -> str:
    """The address to connect to. Every address the name resolves to must be public, so a name that also resolves
    to an inside address is refused rather than tried."""
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError("image_url_failed", detail=str(e), host=host) from None
    addresses = [info[4][0] for info in found]
    if not addresses or not all(public(a) for a in addresses):
        raise InputError("image_url_blocked", detail=", ".join(addresses), host=host)
    return addresses[0]


async def fetch(url: str, limit: int) -> bytes:
    """An image's bytes from a public http(s) URL, at most `limit` of them, within FETCH_S, each redirect checked.

    The connection goes to the address that was checked, not to a second lookup of the name (which a rebinding DNS
    server could answer with an inside address); the Host header and the TLS name stay the URL's. Proxies from the
    environment are not used: they would make the connection for us, unchecked.
    """
    host = httpx.URL(url).host or url
    try:
        async with asyncio.timeout(FETCH_S), httpx.AsyncClient(trust_env=False, timeout=FETCH_S) as client:
            for _ in range(REDIRECTS + 1):
                target = httpx.URL(url)
                host = target.host
                if target.scheme not in ("http", "https") or not host:  # a redirect elsewhere than the web
                    raise InputError("image_url_failed", detail=f"redirected to {url}", host=host or url)
                address = await resolve(host, target.port or (443 if target.scheme == "https" else 80))
                request = client.build_request("GET", target.copy_with(host=address),
                                               headers={"Host": target.netloc.decode("ascii")},
                                               extensions={"sni_hostname": host})
                response = await client.send(request, stream=True)
                try:
                    if response.is_redirect:
                        url = str(target.join(response.headers["location"]))
                        continue
                    response.raise_for_status()
                    data = bytearray()
                    async for chunk in response.aiter_bytes():
                        data += chunk
                        if len(data) > limit:
                            raise InputError("file_too_big", name=Path(target.path).name or host,
                                             limit=size_text(limit))
                    return bytes(data)
                finally:
                    await response.aclose()
            raise InputError("image_url_failed", detail="too many redirects", host=host)
    except (httpx.HTTPError, TimeoutError, KeyError) as e:
        raise InputError("image_url_failed", detail=f"{type(e).__name__}: {e}", host=host) from None


def data_url(url: str, limit: int, field: str) -> bytes:
    """The bytes of a base64 data: URL (data:image/png;base64,…); field names it in the request."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise InputError("bad_field", field=field)
    if len(payload) * 3 // 4 > limit:
        raise InputError("file_too_big", name="image", limit=size_text(limit))
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError("bad_field", field=field) from None
