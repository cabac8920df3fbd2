"""Who may use a served model: accounts, API keys and the loopback rule, one policy for every front door
(the web demo, `qwen-image ui`, and the HTTP server, `qwen-image serve`).

A server listening on a loopback address (127.0.0.0/8, ::1, or a name for them) serves this machine only
and may run without credentials; any other address needs accounts (the demo) or API keys (the server),
or an explicit `--no-auth` (warned).
"""

import argparse
import hashlib
import hmac
import ipaddress
import socket
from pathlib import Path

from qwen_image_fusion.models.errors import InputError


def parse_account(text: str) -> tuple[str, str]:
    """USER:PASS -> (user, password); the password may contain ':'. An argparse type."""
    user, sep, password = text.partition(":")
    if not (sep and user and password):
        raise argparse.ArgumentTypeError(f"expected USER:PASS, got {text!r}")
    return user, password


def read_accounts(path: Path) -> list[tuple[str, str]]:
    """USER:PASS lines of an auth file (blank lines and # comments skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read auth file {path}: {err}") from None
    accounts = []
    for number, line in enumerate(lines, 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                accounts.append(parse_account(line.strip()))
            except argparse.ArgumentTypeError:
                raise InputError(f"{path} line {number}: expected USER:PASS") from None
    if not accounts:
        raise InputError(f"auth file {path} has no USER:PASS line")
    return accounts


MIN_KEY_CHARS = 16  # shorter API keys are refused; make keys with secrets.token_urlsafe()


def read_api_keys(path: Path) -> list[str]:
    """The API keys of a key file: one per line, blank lines and # comments skipped, each at least
    MIN_KEY_CHARS long without spaces; InputError naming the file and line otherwise."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read API key file {path}: {err}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise InputError(
                f"{path} line {number}: an API key is one word of at least {MIN_KEY_CHARS} characters"
            )
        keys.append(key)
    if not keys:
        raise InputError(f"API key file {path} has no key")
    return keys


class ApiKeys:
    """Bearer API keys, compared in constant time: every key is checked, each through a SHA-256 digest, so
    neither the position of a mismatch nor a key's length shows in the time an answer takes."""

    def __init__(self, keys: list[str]) -> None:
        self._digests = [_digest(key) for key in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def matches(self, given: str | None) -> bool:
        """Whether `given` is one of the keys."""
        digest = _digest(given or "")
        return given is not None and sum(hmac.compare_digest(digest, key) for key in self._digests) > 0

    def authorize(self, header: str | None) -> bool:
        """Whether an `Authorization` header carries one of the keys as `Bearer KEY`."""
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and self.matches(token.strip())


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps a server on this machine (127.0.0.0/8, ::1, or a name for them)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return all(ipaddress.ip_address(address).is_loopback for address in addresses)


def check_access(
    host: str, port: int, what: str, credentials: int, no_auth: bool, flags: str, how: str
) -> str | None:
    """Refuse (InputError) a non-loopback `host` with no credentials unless `no_auth`; return the warning to
    print when serving `what` beyond this machine without sign-in. `flags` name the credential options,
    `how` says how to add credentials."""
    if no_auth and credentials:
        raise InputError(f"--no-auth contradicts {flags}: give one or the other")
    if is_loopback(host) or credentials:
        return None
    if not no_auth:
        raise InputError(
            f"--host {host} serves {what} beyond this machine: add {how}, or --no-auth to let anyone who can "
            "reach it in"
        )
    return (
        f"serving on {host}:{port} without sign-in (--no-auth): anyone who can reach this port can use the "
        "model on this machine"
    )
