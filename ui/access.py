"""Who may use a served model: accounts and the loopback rule, one policy for every front door.

A server listening on a loopback address (127.0.0.0/8, ::1, or a name for them) serves this machine only
and may run without accounts; any other address needs accounts, or an explicit `--no-auth` (warned).
"""

import argparse
import ipaddress
import socket
from pathlib import Path

from models.errors import InputError


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
