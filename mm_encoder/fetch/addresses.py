"""Which addresses media may be fetched from, and how hosts are spelled.

`check_ip` is the one rule: None for a public unicast address, else the reason it is refused
(private, loopback, link-local, metadata, ...). IPv6 forms that carry an IPv4 address are judged
by the address inside. Hosts are parsed the way a browser and ``inet_aton`` read them, so numeric
spellings (``2130706433``, ``0x7f.1``, ``0177.0.0.1``) are vetted as the address they really are.
"""

from __future__ import annotations

import ipaddress
import re

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Why explicit tables and not just `ip.is_global`: the stdlib answer changes between Python versions (3.11.10
# and 3.12.4 rewrote it), and it says "global" for several ranges we must refuse: multicast (224.0.0.1),
# IPv4-compatible (::7f00:1), site-local (fec0::/10), local-use NAT64 (64:ff9b:1::/48), unallocated IPv6
# outside 2000::/3, and public-but-dangerous addresses (Azure's 168.63.129.16). The tables give a named reason;
# `is_global` stays as a backstop for whatever special-purpose range they miss.

_METADATA: dict[IPAddress, str] = {
    ipaddress.ip_address("169.254.169.254"): "AWS/GCP/Azure/OpenStack/DigitalOcean instance metadata",
    ipaddress.ip_address("169.254.170.2"): "AWS ECS task metadata",
    ipaddress.ip_address("169.254.170.23"): "AWS EKS pod identity agent",
    ipaddress.ip_address("100.100.100.200"): "Alibaba Cloud metadata",
    ipaddress.ip_address("168.63.129.16"): "Azure WireServer",
    ipaddress.ip_address("fd00:ec2::254"): "AWS instance metadata over IPv6",
    ipaddress.ip_address("fd00:ec2::23"): "AWS EKS pod identity agent over IPv6",
}

_V4_RULES: tuple[tuple[ipaddress.IPv4Network, str], ...] = tuple(
    (ipaddress.IPv4Network(net), reason)
    for net, reason in (
        ("0.0.0.0/8", "unspecified (this network)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("10.0.0.0/8", "private"),
        ("172.16.0.0/12", "private"),
        ("192.168.0.0/16", "private"),
        ("100.64.0.0/10", "CGNAT (shared address space)"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("198.18.0.0/15", "benchmarking"),
        ("192.88.99.0/24", "6to4 relay anycast (deprecated)"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "broadcast"),
        ("240.0.0.0/4", "reserved"),
    )
)

_V6_RULES: tuple[tuple[ipaddress.IPv6Network, str], ...] = tuple(
    (ipaddress.IPv6Network(net), reason)
    for net, reason in (
        ("2001::/32", "Teredo tunnel"),  # the client address inside is obfuscated; never needed for media
        ("64:ff9b:1::/48", "NAT64 local-use"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("fc00::/7", "private (unique local)"),
        ("ff00::/8", "multicast"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("2001:2::/48", "benchmarking"),
        ("100::/64", "discard-only"),
        ("2001::/23", "IETF protocol assignments"),
    )
)
_V6_COMPAT = ipaddress.IPv6Network("::/96")
_V6_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")


def check_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """None if `ip` is a public unicast address we may connect to; else a short reason why not.

    IPv6 forms that carry an IPv4 address (IPv4-mapped, NAT64, 6to4) are judged by the IPv4 address inside,
    because that is what a dual-stack socket or a translator would end up talking to.
    """
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = ipaddress.IPv6Address(int(ip))  # fe80::1%eth0 -> fe80::1
    if ip in _METADATA:
        return f"cloud metadata ({_METADATA[ip]})"
    if isinstance(ip, ipaddress.IPv4Address):
        for net, reason in _V4_RULES:
            if ip in net:
                return reason
        return None if ip.is_global else "non-global (special-purpose)"

    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.ipv4_mapped is not None:
        inner = check_ip(ip.ipv4_mapped)
        return f"IPv4-mapped {ip.ipv4_mapped}: {inner}" if inner else None
    if ip in _V6_COMPAT:
        return "IPv4-compatible (deprecated)"
    if ip in _V6_NAT64:
        v4 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        inner = check_ip(v4)
        return f"NAT64 of {v4}: {inner}" if inner else None
    if ip.sixtofour is not None:
        inner = check_ip(ip.sixtofour)
        if inner:
            return f"6to4 of {ip.sixtofour}: {inner}"
    for net6, reason in _V6_RULES:
        if ip in net6:
            return reason
    if ip not in _V6_GLOBAL_UNICAST:
        return "reserved"
    return None if ip.is_global else "non-global (special-purpose)"


# --- host spellings ---------------------------------------------------------------------------------

HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?(?:\.[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?)*"
)
_ENDS_IN_NUMBER = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
_HEX_LABEL = re.compile(r"0[xX][0-9a-fA-F]*")
_OCT_LABEL = re.compile(r"0[0-7]+")
_DEC_LABEL = re.compile(r"0|[1-9][0-9]*")


def numeric_ipv4_host(host: str) -> bool:
    """Whether a browser (WHATWG "ends in a number") would read `host` as an IPv4 address."""
    labels = host.split(".")
    if len(labels) > 1 and labels[-1] == "":
        labels.pop()
    return bool(_ENDS_IN_NUMBER.fullmatch(labels[-1]))


def parse_numeric_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """Decode decimal/octal/hex IPv4 spellings (``2130706433``, ``0x7f.1``, ``0177.0.0.1``) like inet_aton.

    None if the host is malformed as a number (``1.2.3.4.5``, ``09.1``, ``4294967296``).
    """
    labels = host.split(".")
    if len(labels) > 1 and labels[-1] == "":
        labels.pop()
    if not 1 <= len(labels) <= 4:
        return None
    parts: list[int] = []
    for label in labels:
        if _HEX_LABEL.fullmatch(label):
            parts.append(int(label[2:] or "0", 16))
        elif _OCT_LABEL.fullmatch(label):
            parts.append(int(label, 8))
        elif _DEC_LABEL.fullmatch(label):
            parts.append(int(label, 10))
        else:  # empty, signs, underscores, non-ASCII digits, 08/09: int() would take some of these; we do not
            return None
    *head, last = parts
    if any(p > 255 for p in head) or last >= 256 ** (5 - len(parts)):
        return None
    value = last
    for i, p in enumerate(head):
        value += p << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def normalise_host_name(name: str) -> str:
    name = name.lower().rstrip(".")
    try:
        return name.encode("idna").decode("ascii") if not name.isascii() else name
    except UnicodeError:
        return name
