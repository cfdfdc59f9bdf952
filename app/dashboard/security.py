"""Who may read and who may change things on the dashboard. Pure: headers in, verdicts out.

- Reads (the page, snapshots, events) are open to whoever reaches the socket, which binds
  127.0.0.1 unless told otherwise; and while it is bound to loopback, a request must name a
  loopback host in `Host`, so that a web page whose DNS name was rebound to 127.0.0.1
  cannot read it from the victim's browser.
- Writes (the saturation policy, the demo's burst) need `Authorization: Bearer <admin
  token>` when one is set (`--admin-token`; a non-loopback `--dashboard-host` requires one),
  and are refused when a browser says they come from another origin (`Origin`, or
  `Sec-Fetch-Site` for browsers that omit it), so that no other site can flip the switch
  through a visitor's browser.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from app.config import is_loopback_host

CROSS_SITE_FETCHES = frozenset({"cross-site", "same-site"})


def _hostname(host_header: str) -> str | None:
    """The host name of a `Host` header value (brackets and port dropped)."""
    try:
        return urlsplit(f"//{host_header}").hostname
    except ValueError:
        return None


def host_allowed(host_header: str | None, bound_host: str) -> bool:
    if not is_loopback_host(bound_host):
        return True
    if not host_header:
        return False
    name = _hostname(host_header)
    return name is not None and is_loopback_host(name)


def same_origin(origin: str | None, sec_fetch_site: str | None, host_header: str | None) -> bool:
    """False when the browser says the request comes from another origin.

    No `Origin` and no `Sec-Fetch-Site`: not a browser's cross-origin request (curl, scripts).
    """
    if sec_fetch_site is not None and sec_fetch_site.lower() in CROSS_SITE_FETCHES:
        return False
    if origin is None:
        return True
    if origin == "null" or not host_header:
        return False
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host_header.lower()


def bearer_matches(authorization: str | None, token: str) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time."""
    if not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
