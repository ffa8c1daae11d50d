"""Sign-in for a shared server, as Jupyter does it: one token per server, given once in a link, after which
the browser holds a keyed digest of it (never the token itself). The page that asks for it is
pages/sign_in.py; everything that decides lives here.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path
from urllib.parse import quote, unquote

LOOPBACK = ("localhost", "127.0.0.1", "::1")
COOKIE = "explorer_auth"
NAME_COOKIE = "explorer_name"  # who signed in with the token, so a returning browser's runs keep their owner
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._@-]{0,39}")
NAME_ALLOWED = "1 to 40 characters: letters, digits, space, '.', '_', '@', '-', starting with a letter or digit"


def is_exposed(address: str | None) -> bool:
    """Whether a server bound to `address` is reachable beyond this machine (no address: every interface)."""
    return (address or "0.0.0.0") not in LOOPBACK


def server_token(data_dir: Path) -> tuple[str, Path | None]:
    """EXPLORER_TOKEN, else a token generated once per data folder, kept there readable by its owner only.
    Returns the token and the file it is kept in (None when it came from the environment)."""
    if os.environ.get("EXPLORER_TOKEN"):
        return os.environ["EXPLORER_TOKEN"], None
    path = data_dir / "server_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: two processes starting at once agree on one token
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_urlsafe(32).encode())
        os.close(fd)
    except FileExistsError:
        pass
    return path.read_text().strip(), path


def session_proof(token: str) -> str:
    """What the cookie holds: a keyed digest of the token, so the cookie alone does not reveal it."""
    return hmac.new(token.encode(), b"explorer-session", hashlib.sha256).hexdigest()


def same(given: str, expected: str) -> bool:
    """Constant-time comparison (a token or a proof)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def admins() -> set[str]:
    """With an OIDC provider, the emails allowed to cancel anyone's run (EXPLORER_ADMINS, comma-separated)."""
    return {a.strip() for a in os.environ.get("EXPLORER_ADMINS", "").split(",") if a.strip()}


def check_name(name: str) -> str:
    """The name a token holder signs in with (recorded as their runs' owner), or ValueError naming the field and
    what is allowed. Without an identity provider this is what the person says, not a proof of who they are."""
    name = name.strip()
    if not NAME.fullmatch(name):
        raise ValueError(f"name: {name[:60]!r} is not allowed (allowed: {NAME_ALLOWED})")
    return name


def name_cookie_value(name: str) -> str:
    return quote(check_name(name))


def name_from_cookie(value: str | None) -> str | None:
    """The name a browser's cookie holds, if it is an allowed one."""
    try:
        return check_name(unquote(value)) if value else None
    except ValueError:
        return None
