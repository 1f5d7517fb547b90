"""Bearer tokens, the one check HTTP (``app.dependencies``) and gRPC (``app.v2.grpc_service``)
share.

>>> from pydantic import SecretStr
>>> key = SecretStr("s3cret")
>>> bearer_allows("Bearer s3cret", key), bearer_allows("s3cret", key), bearer_allows(None, key)
(True, False, False)
"""

from __future__ import annotations

import secrets

from pydantic import SecretStr


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, or None."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_allows(authorization: str | None, expected: SecretStr) -> bool:
    """Whether ``authorization`` carries ``expected`` as its bearer token (compared in
    constant time)."""
    token = bearer_token(authorization)
    return token is not None and secrets.compare_digest(
        token.encode(), expected.get_secret_value().encode()
    )
