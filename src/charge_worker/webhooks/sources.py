"""Where a delivery comes from, for a provider that does not sign its notifications (YooKassa).

Such a delivery is taken only from the provider's published networks
(`CHARGE_WORKER_WEBHOOK_SOURCE_NETWORKS`); whatever it says is then only a hint of which
object to re-fetch (the processor applies what the provider answers). The source is the TCP
peer, unless the peer is one of `CHARGE_WORKER_WEBHOOK_TRUSTED_PROXIES` (the ingress): then
it is the right-most `X-Forwarded-For` address that is not itself a trusted proxy.

| peer                  | `X-Forwarded-For` (all lines, in order) | source                      |
|-----------------------|-----------------------------------------|-----------------------------|
| not a trusted proxy   | anything (ignored)                      | the peer                    |
| a trusted proxy       | `a, b, p2` (`p2` trusted, `b` not)      | `b`                         |
| a trusted proxy       | every entry trusted, or none            | the left-most trusted hop   |
| a trusted proxy       | `a, junk` (`junk` no address)           | `junk`: refused             |
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from charge_worker.errors import ForeignSource, SettingsError
from charge_worker.settings import WebhookSettings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_LOGGED = 64  # characters of a forwarded entry that is no address


@dataclass(frozen=True)
class Source:
    """The sender as read: `text` as it was seen (bounded), `address` when it is one."""

    text: str
    address: Address | None


def parse_address(text: str) -> Address | None:
    """An IPv4 or IPv6 address (an IPv4-mapped IPv6 one as its IPv4), or None."""
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack socket shows IPv4 peers this way
    return address


def inside(address: Address | None, networks: Iterable[Network]) -> bool:
    """`address` is in one of `networks` (an IPv4 address is never in an IPv6 network)."""
    return address is not None and any(address in network for network in networks)


def source_of(
    peer: str | None, forwarded_for: Sequence[str], trusted_proxies: Sequence[Network]
) -> Source:
    """The delivery's source: the TCP `peer`, or behind a trusted proxy the right-most
    entry of the `X-Forwarded-For` lines that is not a trusted proxy itself."""
    hop = Source(peer or "", parse_address(peer or ""))
    if not inside(hop.address, trusted_proxies):
        return hop
    entries = [entry.strip() for line in forwarded_for for entry in line.split(",")]
    # walked from the right: each proxy appends the address it was called from, so the
    # right-most entries are the ones our own proxies wrote; the left-most are whatever the
    # client sent in its own X-Forwarded-For, and a forger can put any address there
    for entry in reversed(entries):
        address = parse_address(entry)
        if not inside(address, trusted_proxies):
            return Source(entry[:MAX_LOGGED], address)
        hop = Source(entry, address)
    return hop


@dataclass(frozen=True)
class SourceCheck:
    """Admits deliveries whose source is inside `networks`."""

    networks: tuple[Network, ...]
    trusted_proxies: tuple[Network, ...] = ()

    def __post_init__(self) -> None:
        if not self.networks:
            raise SettingsError(
                "CHARGE_WORKER_WEBHOOK_SOURCE_NETWORKS is empty; the yookassa scheme would "
                "refuse every notification"
            )

    @classmethod
    def from_settings(cls, cfg: WebhookSettings) -> SourceCheck:
        """The check for the configured networks and proxies."""
        return cls(cfg.webhook_source_networks, cfg.webhook_trusted_proxies)

    def check(self, peer: str | None, forwarded_for: Sequence[str]) -> Source:
        """The source, when inside the networks; `ForeignSource` otherwise."""
        source = source_of(peer, forwarded_for, self.trusted_proxies)
        if not inside(source.address, self.networks):
            raise ForeignSource(source.text)
        return source
