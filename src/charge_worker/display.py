"""Text fit to show an operator: on a terminal, or in a log line.

Message bodies, headers and anything a dependency says are data from outside: printed as
they are, an escape sequence in them moves the cursor, retitles the window or hides what
follows. Server addresses are configuration that may hold credentials.
"""

from __future__ import annotations

import re

HIDDEN = "***"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# Query parameters and `key=value` DSN words that carry a secret (libpq's password,
# sslpassword; a token or key in any URL).
_SECRET_PARAM = re.compile(r"(?i)\b([\w.-]*(?:pass|secret|token|key)[\w.-]*)=([^&\s]*)")


def printable(text: str) -> str:
    """`text` with every character a terminal would not simply print (controls, format
    characters such as bidirectional overrides, line and paragraph separators) escaped as
    Python's repr escapes it (`\\n`, `\\x1b`, `\\u202e`); printable Unicode is kept."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def without_credentials(url: str) -> str:
    """A server address, or a comma-separated list of them, with the user, password or token
    of each hidden (`nats://***@host:4222`) and so are secret parameters (`password=***`)."""
    starts = [match.start() for match in _SCHEME.finditer(url)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    ends = [*starts[1:], len(url)]
    return "".join(_one_without_credentials(url[a:b]) for a, b in zip(starts, ends, strict=True))


def _one_without_credentials(url: str) -> str:
    scheme = _SCHEME.match(url)
    head = scheme.group() if scheme else ""
    # The last "@" ends the credentials even when a password holds an unencoded "@", "/",
    # "?" or ",": hiding a little of the address is better than showing a little secret.
    _, at, rest = url[len(head) :].rpartition("@")
    shown = f"{head}{HIDDEN}@{rest}" if at else url
    return _SECRET_PARAM.sub(rf"\1={HIDDEN}", shown)
