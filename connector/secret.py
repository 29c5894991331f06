"""The deployment secret: what every engine of one P/D deployment shares.

One file (``kvplane_secret_file`` in ``kv_connector_extra_config``, or the
environment variable ``KVPLANE_SECRET_FILE``) holds one secret per line:

- line 1 signs: the key P vouches for its ``kv_transfer_params`` with, and
  the CURVE keypair every engine's side channel serves and connects with;
- line 2 (optional) is accepted too: params it signed verify, and its CURVE
  public key is on every side channel's allow-list.  That is what rotation
  needs (docs/security.md: add the new secret as line 2 everywhere, then
  swap the lines, then drop the old one).

Each secret is at least 32 characters (``secrets.token_hex(32)`` makes
one); blank lines and surrounding whitespace are ignored.  From each, HMAC-
SHA256 with distinct labels derives independent keys: the params MAC key,
the CURVE secret key (32 bytes, z85) and a short key id that names the
secret in the params without revealing it.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

import attrs
import zmq
from zmq.utils import z85

from kvplane.statemachines.config import ConfigError

SECRET_ENV = "KVPLANE_SECRET_FILE"
SECRET_KEY = "kvplane_secret_file"
MIN_SECRET_CHARS = 32
MAX_SECRETS = 2
_LABEL_MAC = b"kvplane/params-mac/v1"
_LABEL_CURVE = b"kvplane/curve-secret/v1"
_LABEL_ID = b"kvplane/key-id/v1"


@attrs.frozen
class DerivedKey:
    """The keys one deployment secret gives."""

    key_id: str  # 16 hex digits, named in the params (not secret)
    mac_key: bytes = attrs.field(repr=False)
    curve_public: bytes  # z85, 40 bytes
    curve_secret: bytes = attrs.field(repr=False)  # z85, 40 bytes

    @property
    def curve_keypair(self) -> tuple[bytes, bytes]:
        return self.curve_public, self.curve_secret


@attrs.frozen
class DeploymentKeys:
    """``signing``: the key of line 1; ``accepted``: every line's, line 1 first."""

    signing: DerivedKey
    accepted: tuple[DerivedKey, ...]

    def by_id(self, key_id: object) -> DerivedKey | None:
        return next((k for k in self.accepted if k.key_id == key_id), None)

    @property
    def public_keys(self) -> tuple[bytes, ...]:
        return tuple(k.curve_public for k in self.accepted)


def _derive_bytes(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


def derive(secret: bytes) -> DerivedKey:
    curve_secret = z85.encode(_derive_bytes(secret, _LABEL_CURVE))
    return DerivedKey(key_id=_derive_bytes(secret, _LABEL_ID).hex()[:16], mac_key=_derive_bytes(secret, _LABEL_MAC),
                      curve_public=zmq.curve_public(curve_secret), curve_secret=curve_secret)


def keys_from_text(text: str, *, source: str = "the secret file", key: str = SECRET_KEY) -> DeploymentKeys:
    """The deployment keys of a secret file's text; ConfigError (naming
    ``key``) when it holds no secret, more than two, or a short one."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not 1 <= len(lines) <= MAX_SECRETS:
        raise ConfigError(key, f"{source}: needs 1 or {MAX_SECRETS} secrets (one a line), found {len(lines)}")
    for n, line in enumerate(lines, 1):
        if len(line) < MIN_SECRET_CHARS:
            raise ConfigError(key, f"{source}: the secret on line {n} has {len(line)} characters; at least "
                                   f"{MIN_SECRET_CHARS} are needed (python -c 'import secrets; "
                                   "print(secrets.token_hex(32))')")
    derived = tuple(derive(line.encode("utf-8")) for line in lines)
    if len({d.key_id for d in derived}) != len(derived):
        raise ConfigError(key, f"{source}: the same secret twice")
    return DeploymentKeys(signing=derived[0], accepted=derived)


def load_keys(path: str | os.PathLike, *, key: str = SECRET_KEY) -> DeploymentKeys:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read the secret file {os.fspath(path)!r}: {exc}") from None
    return keys_from_text(text, source=f"secret file {os.fspath(path)!r}", key=key)


def write_secret_file(path: str | os.PathLike, *, previous: str | None = None) -> str:
    """Write a fresh secret (owner-only permissions) to ``path``, with
    ``previous`` as the accepted second line if given; returns the secret."""
    secret = secrets.token_hex(32)
    text = secret + "\n" + (previous + "\n" if previous else "")
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return secret
