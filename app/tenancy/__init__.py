"""Tenants: API keys with scopes (``keys``), per-tenant quotas (``quota``) and the gate
that checks both for every request (``gate``)."""

from app.tenancy.gate import PRIORITY, TOP_PRIORITY, Tenancy, parse_priority
from app.tenancy.keys import ANONYMOUS, Caller, Keyring, Scope, Tenant, bearer_token, key_hash
from app.tenancy.quota import LocalBuckets, RedisBuckets, Verdict

__all__ = [
    "ANONYMOUS",
    "PRIORITY",
    "TOP_PRIORITY",
    "Caller",
    "Keyring",
    "LocalBuckets",
    "RedisBuckets",
    "Scope",
    "Tenancy",
    "Tenant",
    "Verdict",
    "bearer_token",
    "key_hash",
    "parse_priority",
]
