"""MQTT server URLs, as the daemon's configuration and the schedulers' client take them:
one parser, so both refuse the same URLs with the same sentences."""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["MAX_HOST_CHARS", "parse_mqtt_url"]


MAX_HOST_CHARS = 253
"""The longest host name DNS has (RFC 1035)."""


def parse_mqtt_url(url: str) -> tuple[str, int, bool]:
    """`mqtt://HOST[:PORT]`, `mqtts://HOST[:PORT]` or a bare `HOST[:PORT]` (plain MQTT)
    → (host, port, tls). Raises ValueError with a sentence saying what is wrong."""
    text = url.strip()
    shown = repr(url) if len(url) <= 80 else f"{url[:80]!r}…({len(url)} chars)"
    if "://" not in text:
        text = "mqtt://" + text
    try:
        u = urlsplit(text)
    except ValueError as exc:  # `Invalid IPv6 URL`: an unmatched [
        raise ValueError(f"MQTT URL {shown}: {exc}") from None
    if u.scheme not in ("mqtt", "mqtts"):
        raise ValueError(f"MQTT URL {url!r}: the scheme must be mqtt:// or mqtts://")
    if u.username or u.password:
        raise ValueError(f"MQTT URL {url!r}: put no credentials in the URL")
    if not u.hostname or u.path not in ("", "/") or u.query or u.fragment:
        raise ValueError(f"MQTT URL {url!r}: expected mqtt://HOST[:PORT]")
    try:
        port = u.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"MQTT URL {url!r}: the port must be a number from 1 to 65535")
    host = u.hostname
    if len(host) > MAX_HOST_CHARS or any(ord(c) <= 0x20 or 0x7F <= ord(c) < 0xA0
                                         for c in host):
        raise ValueError(f"MQTT URL {shown}: the host is no host name (at most "
                         f"{MAX_HOST_CHARS} characters, no spaces or control characters)")
    try:  # what connecting does first; its UnicodeError came from deep in the connect
        host.encode("idna")
    except UnicodeError:
        raise ValueError(f"MQTT URL {shown}: the host is no host name (each dot-separated "
                         "label 1 to 63 characters, IDNA)") from None
    tls = u.scheme == "mqtts"
    return host, port or (8883 if tls else 1883), tls
