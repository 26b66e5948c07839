"""API keys and their ids: one format for the keys file, the config secret and the batch worker.

A key is written ``<id>:<secret>``, one a line in the mounted file (the
config secret also takes commas). The id names the key wherever the key
itself must not appear: the access log, the per-key metrics, the per-key
limits. A line without an id (the format before ids existed) still works;
its id is then :func:`fingerprint` of the secret.

Why ``<id>:<secret>`` and a fingerprint for old lines:

* An explicit id reads well on a dashboard ("search-team", "batch-worker")
  and survives a rotation: the new secret keeps the id, so a key's series
  and limits carry on.
* The separator can not be confused with a key: a bearer token (RFC 6750
  ``b64token``) has no ``:``. So a line with a ``:`` always has an id, and a
  line without one is always an old key.
* The fingerprint is 48 bits of SHA-256 over a fixed prefix and the secret:
  stable across restarts and replicas (the series of an old key stay
  continuous), and it says nothing usable about a secret of 24 or more
  random characters. It is not a digest the guard compares against.

This module needs the standard library alone: the Pulumi program, the guard
and the batch worker all read keys through it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# Lowercase letters, digits and "-", 1 to 32 characters, alphanumeric at both
# ends: safe as a Prometheus label value, a JSON log field and a YAML key.
KEY_ID_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$"
_KEY_ID = re.compile(KEY_ID_PATTERN)
KEY_ID_RULE = "1-32 lowercase letters, digits and '-', starting and ending with a letter or digit"
# The id the platform gives the batch worker's own key (infra/serving/namespace.py);
# no client key may take it.
BATCH_WORKER_KEY_ID = "batch-worker"
FINGERPRINT_PREFIX = "key-"
_FINGERPRINT_DOMAIN = b"inference-api-key-id\x00"
_FINGERPRINT_HEX = 12


def fingerprint(secret: str) -> str:
    """The id of a key written without one: ``key-`` and 12 hex digits of a domain-separated SHA-256."""
    digest = hashlib.sha256(_FINGERPRINT_DOMAIN + secret.encode()).hexdigest()
    return FINGERPRINT_PREFIX + digest[:_FINGERPRINT_HEX]


def valid_key_id(value: str) -> bool:
    """Whether ``value`` may name a key."""
    return bool(_KEY_ID.match(value))


@dataclass(frozen=True)
class ApiKey:
    """One key: its id, and the secret (kept out of ``repr``, so it never lands in a log by accident)."""

    id: str
    secret: str = field(repr=False)
    # Whether the id was written (False: derived with fingerprint()).
    explicit: bool = True

    def line(self) -> str:
        """The key as one line of the keys file."""
        return f"{self.id}:{self.secret}"


class KeyFormatError(ValueError):
    """An entry that is not ``<id>:<secret>`` nor a bare secret. The message never holds the secret."""


def parse_entry(text: str, where: str) -> ApiKey:
    """One entry (already stripped); ``where`` names it in an error ("line 3", "key 2")."""
    key_id, colon, secret = text.partition(":")
    if not colon:
        return ApiKey(fingerprint(text), text, explicit=False)
    key_id, secret = key_id.strip(), secret.strip()
    if not valid_key_id(key_id):
        # The text before ':' may be a secret pasted by mistake: never show it.
        raise KeyFormatError(f"{where}: the key id before ':' must be {KEY_ID_RULE}")
    if not secret:
        raise KeyFormatError(f"{where}: key '{key_id}' has no secret after ':'")
    if ":" in secret:
        raise KeyFormatError(f"{where}: key '{key_id}': a key may not contain ':' (write it as <id>:<secret>)")
    return ApiKey(key_id, secret)


def _entries(lines: Iterable[tuple[str, str]]) -> tuple[list[ApiKey], list[str]]:
    keys: list[ApiKey] = []
    problems: list[str] = []
    for where, raw in lines:
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            keys.append(parse_entry(text, where))
        except KeyFormatError as err:
            problems.append(str(err))
    return keys, problems


def parse_keys_text(text: str) -> tuple[list[ApiKey], list[str]]:
    """The keys of a keys file (one a line; blank lines and ``#`` comments ignored), and one problem per bad line."""
    return _entries((f"line {i}", line) for i, line in enumerate(text.splitlines(), start=1))


def parse_keys_list(text: str) -> tuple[list[ApiKey], list[str]]:
    """The keys of the config secret or an environment variable: separated by commas or newlines."""
    parts = re.split(r"[,\n]", text)
    return _entries((f"key {i}", part) for i, part in enumerate((p for p in parts if p.strip()), start=1))


def keys_file(keys: Iterable[ApiKey]) -> str:
    """The mounted file: ``<id>:<secret>`` a line, every id written out (fingerprints too)."""
    return "".join(f"{k.line()}\n" for k in keys)
