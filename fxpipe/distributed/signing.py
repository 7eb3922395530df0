"""Failure records that only the job's own ranks can write: HMAC-SHA256 with a job secret.

The rendezvous store has no authentication: any process on the machine that can reach
its port (every local user, when it listens on 127.0.0.1) can read and write any key.
So a record in the store proves nothing by itself. ``fxpipe.distributed.launch`` and
``python -m fxpipe.distributed`` draw a random secret per job and hand it to their ranks
in the environment (``FXPIPE_JOB_SECRET``; it is never written to the store). A rank
signs what it records with :func:`sign`; readers believe a record only when
:func:`verify` finds the MAC of this job's secret over the key and the payload, so a
forged record, or a genuine one copied to another key, is ignored.

Under a launcher that hands out no secret (plain ``torchrun``) there is nothing to sign
with: records are stored and read as they are, as before.

The watchdog's "first failure wins" uses ``compare_set``; a forged record written first
would block it, so :func:`publish_first` replaces any record that does not verify.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Any

SECRET_ENV = "FXPIPE_JOB_SECRET"
_SCHEME = "hmac-sha256"
_ATTEMPTS = 8  # compare_set rounds against a writer that keeps forging, before giving up


def new_secret() -> str:
    """A fresh job secret: 256 random bits, hex."""
    return secrets.token_hex(32)


def job_secret() -> str | None:
    """This process's job secret (from ``FXPIPE_JOB_SECRET``), or None when it has none."""
    return os.environ.get(SECRET_ENV) or None


def _mac(secret: str, key: str, payload: str) -> str:
    message = key.encode() + b"\0" + payload.encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(key: str, payload: str, secret: str | None = None) -> str:
    """The record to store under ``key``: ``payload`` with its MAC.

    ``secret`` defaults to :func:`job_secret`; without one the payload is returned
    unchanged (nothing to sign with).
    """
    secret = secret or job_secret()
    if secret is None:
        return payload
    return f"{_SCHEME}:{_mac(secret, key, payload)}:{payload}"


def verify(key: str, record: str | bytes, secret: str | None = None) -> str | None:
    """The payload of ``record`` if this job signed it for ``key``, else None.

    ``secret`` defaults to :func:`job_secret`. With a secret, an unsigned, malformed or
    wrongly signed record (forged, from another job, or copied from another key) gives
    None. Without one, every record is returned as it is.
    """
    text = record.decode(errors="replace") if isinstance(record, bytes) else record
    secret = secret or job_secret()
    if secret is None:
        return text
    scheme, _, rest = text.partition(":")
    mac, _, payload = rest.partition(":")
    if scheme != _SCHEME or not hmac.compare_digest(mac, _mac(secret, key, payload)):
        return None
    return payload


def read_verified(store: Any, key: str, secret: str | None = None) -> str | None:
    """The payload stored under ``key`` if it verifies; None when absent or not genuine."""
    if not store.check([key]):
        return None
    return verify(key, store.get(key), secret)


def publish_first(store: Any, key: str, payload: str, secret: str | None = None) -> str:
    """Record ``payload`` under ``key`` unless a genuine record is there already.

    Returns the payload of the genuine record the store now holds: the first one a rank
    of this job wrote (possibly this one). A record that does not verify is overwritten.
    If another process keeps overwriting the key faster than this loop, ``payload``
    itself is returned after a few rounds (the caller still reports its own failure).
    """
    record = sign(key, payload, secret)
    expected: str | bytes = ""
    for _ in range(_ATTEMPTS):
        current = store.compare_set(key, expected, record)
        genuine = verify(key, current, secret)
        if genuine is not None:
            return genuine
        # replace what is there; compare_set answers ``expected`` itself for a missing key
        expected = "" if current == expected else current
    return payload
