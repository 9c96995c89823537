"""Where the manager listens: ``check_listen_address`` reads ``llm_server.host``
and ``llm_server.port`` before any model loads; a manager listening beyond
loopback warns that its port must be firewalled (``is_loopback``)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any


def check_listen_address(host: Any, port: Any) -> tuple[str, int]:
    """``(host, port)`` for the manager to listen on (``llm_server.host``,
    ``llm_server.port``); ValueError naming the key otherwise. Read before any
    model loads, and again by the manager."""
    if not isinstance(host, str) or not host.strip() or host != host.strip():
        hint = " (an empty host listens on every interface without saying so)" if host == "" else ""
        raise ValueError(f"llm_server.host must be the address to listen on: 127.0.0.1 for workers on this "
                         f"machine, 0.0.0.0 for workers on other machines; got {host!r}{hint}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"llm_server.port must be an integer from 0 to 65535 (0: any free port), got {port!r}")
    _check_bindable(host)
    return host, port


def _check_bindable(host: str) -> None:
    """ValueError naming ``llm_server.host`` unless the manager can listen on
    it: an IPv4 address (or a name for one) of this machine. Tried on a free
    port, so that a wrong host is found before a model loads, not when the
    manager binds after it."""
    try:
        infos = socket.getaddrinfo(host, 0, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        ipv6 = ":" in host
        why = ("the manager listens on IPv4 only: use 127.0.0.1 for workers on this machine, 0.0.0.0 for "
               "workers on other machines" if ipv6 else f"it does not resolve to an IPv4 address ({exc.strerror})")
        raise ValueError(f"llm_server.host={host!r} cannot be listened on: {why}") from None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((infos[0][4][0], 0))
    except OSError as exc:
        raise ValueError(f"llm_server.host={host!r} cannot be listened on: {exc.strerror or exc} (an address of "
                         "this machine, 127.0.0.1 or 0.0.0.0)") from None



def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (an IPv6 zone, ``%eth0``, ignored)."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False
