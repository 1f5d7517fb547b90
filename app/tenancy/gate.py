"""``Tenancy``: the one place a request's key becomes a caller, its priority a ``Ticket``, and
its images are drawn from its tenant's quota. HTTP (``app.dependencies``), gRPC
(``app.v2.grpc_service``) and the Predictor ask it; the keys file is re-read on SIGHUP (a file
with an error keeps the keys that were in force, and says why)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

from app.batching import Ticket
from app.errors import Forbidden, InvalidParameter, QuotaExceeded, SettingsError, Unauthorized
from app.tenancy.keys import Caller, Keyring, Scope, Tenant, bearer_token
from app.tenancy.quota import LocalBuckets, RedisBuckets, Verdict

if TYPE_CHECKING:
    from app.metrics import Metrics
    from app.settings import Settings

log = logging.getLogger("app")

PRIORITY = "X-Priority"  # the header a request asks its priority with (1 is the highest)
TOP_PRIORITY = 1  # the most urgent a request may ask (its key may cap it lower)

# What a request without the right key is told to send, by where the keys come from.
_SETTING_FOR = {Scope.INFER: "API_KEY", Scope.ADMIN: "ADMIN_API_KEY"}


class Tenancy:
    """Keys, scopes, quotas and priorities of one server process: ``caller`` (who asks,
    and may they), ``ticket`` (where their work queues), ``charge`` (their quota).

    >>> gate = Tenancy(Keyring.of_settings("s3cret", None))
    >>> gate.caller("Bearer s3cret", Scope.INFER).tenant
    'default'
    >>> gate.caller(None, Scope.INFER)
    Traceback (most recent call last):
    app.errors.Unauthorized: send 'Authorization: Bearer <API_KEY>'
    """

    def __init__(
        self,
        keyring: Keyring,
        path: Path | None = None,
        buckets: LocalBuckets | RedisBuckets | None = None,
        metrics: Metrics | None = None,
        *,
        levels: int = 1,
        default_priority: int | None = None,
    ) -> None:
        self.levels = levels
        self.default_priority = default_priority or levels  # unset: the lowest level
        self.keyring = self._checked(keyring)
        self._path = path
        self._buckets = buckets or LocalBuckets()
        self._metrics = metrics

    @classmethod
    def of_settings(
        cls,
        settings: Settings,
        metrics: Metrics | None = None,
        redis_buckets: Callable[[LocalBuckets], RedisBuckets] | None = None,
    ) -> Tenancy:
        """The keys file, or ``API_KEY``/``ADMIN_API_KEY``; quotas in Redis when
        ``redis_buckets`` builds them (broker mode). ``SettingsError`` when the file is bad."""
        path = settings.mb_keys_file
        if path is not None:
            if settings.api_key is not None or settings.admin_api_key is not None:
                raise SettingsError(
                    "MB_KEYS_FILE replaces API_KEY and ADMIN_API_KEY: set one or the other "
                    "(give those keys an entry in the file)"
                )
            keyring = Keyring.read(path)
        else:
            keyring = Keyring.of_settings(
                _secret(settings.api_key), _secret(settings.admin_api_key)
            )
        local = LocalBuckets()
        buckets = redis_buckets(local) if redis_buckets is not None else local
        return cls(
            keyring,
            path,
            buckets,
            metrics,
            levels=len(settings.mb_priority_levels),
            default_priority=settings.mb_default_priority,
        )

    def _checked(self, keyring: Keyring) -> Keyring:
        """``keyring``, if every priority it names is one of the levels."""
        for caller in keyring.callers:
            for priority in (caller.priority, caller.top_priority):
                if priority is not None and priority > self.levels:
                    raise SettingsError(
                        f"{keyring.source}: tenant {caller.tenant}'s key has priority "
                        f"{priority}, but MB_PRIORITY_LEVELS has {self.levels} level(s)"
                    )
        return keyring

    def ticket(self, caller: Caller | None, asked: object = None, where: str = PRIORITY) -> Ticket:
        """Where a request of ``caller`` queues: the priority it ``asked`` (``where`` names
        the field, for the 422 a malformed one gets; 0 or None: its key's default, else
        ``MB_DEFAULT_PRIORITY``), never above its key's ``top_priority``; its tenant's
        turn and weight in a batch."""
        level = parse_priority(asked, self.levels, where)
        own = (
            self.default_priority if caller is None or caller.priority is None else caller.priority
        )
        top = own if caller is None or caller.top_priority is None else caller.top_priority
        # 1 is the highest: a key's allowance caps what it asks, and what it gets unasked
        # (MB_DEFAULT_PRIORITY may be above a key's top_priority).
        level = max(own if level is None else level, top)
        if caller is None:
            return Ticket(None, level - 1)
        return Ticket(caller.tenant, level - 1, self.keyring.tenant(caller.tenant).weight)

    def key_name(self, scope: Scope) -> str:
        """What to put after ``Bearer``, for a refusal's message."""
        if self._path is None and scope in _SETTING_FOR:
            return _SETTING_FOR[scope]
        return f"a key with the {scope.value} scope"

    def caller(self, authorization: str | None, scope: Scope, where: str = "header") -> Caller:
        """The caller an ``Authorization`` value stands for, if it may use ``scope``. A
        scope open to a request without a key is open to every request (its key, if known
        and allowed, names the caller; otherwise it is the anonymous caller). Else
        ``Unauthorized`` (401) when the key is missing or unknown, ``Forbidden`` (403) when
        the key is known but lacks the scope. ``where`` words the message ("header" for
        HTTP, "metadata" for gRPC)."""
        ring = self.keyring
        caller = None
        if authorization is not None:
            token = bearer_token(authorization)
            caller = ring.caller(token) if token is not None else None
        if caller is not None and caller.allows(scope):
            return caller
        anonymous = ring.anonymous
        if anonymous is not None and anonymous.allows(scope):
            return anonymous
        if scope is Scope.ADMIN and not ring.any_allows(Scope.ADMIN):
            raise Unauthorized("ADMIN_API_KEY is not set: loading and unloading are off")
        if caller is None:  # no key, not a bearer token, or an unknown key
            send = "metadata 'authorization" if where == "metadata" else "'Authorization"
            raise Unauthorized(f"send {send}: Bearer <{self.key_name(scope)}>'")
        raise Forbidden(
            f"this key (tenant {caller.tenant}) lacks the {scope.value} scope: send "
            f"Bearer <{self.key_name(scope)}>"
        )

    async def charge(self, ticket: Ticket, images: int) -> None:
        """Draw ``images`` from the ticket's tenant's quota: ``QuotaExceeded`` (429) when
        its bucket lacks them; ``InvalidParameter`` (422) for a request larger than the
        bucket itself (it could never pass: split it)."""
        tenant = str(ticket.tenant)
        share = self.keyring.tenant(tenant)
        if share.rate is None:
            self._count(tenant, images, True)
            return
        if images > share.burst:
            raise InvalidParameter(
                f"{images} images in one request is more than tenant {tenant}'s burst "
                f"of {int(share.burst)}: send them in smaller requests"
            )
        verdict = await self._buckets.draw(share, images)
        self._count(tenant, images, verdict.allowed)
        if not verdict.allowed:
            raise self._over(share, verdict)

    @staticmethod
    def _over(share: Tenant, verdict: Verdict) -> QuotaExceeded:
        return QuotaExceeded(
            f"tenant {share.name} is over its quota of {share.rate:g} images/s "
            f"(burst {int(share.burst)})",
            retry_after_s=verdict.retry_after_s,
            headers=verdict.headers(share),
        )

    def _count(self, tenant: str, images: int, allowed: bool) -> None:
        if self._metrics is not None:
            self._metrics.on_tenant_images(tenant, images, allowed)

    def reload(self) -> bool:
        """Read the keys file again (SIGHUP); on an error keep the keys in force and log why.
        Whether the new keys are in force."""
        if self._path is None:
            return False
        try:
            keyring = self._checked(Keyring.read(self._path))
        except SettingsError as exc:
            log.error("keys not reloaded, the previous keys stay in force: %s", exc)
            return False
        self.keyring = keyring
        log.info("keys reloaded from %s: tenants %s", self._path, ", ".join(keyring.tenants))
        return True

    async def aclose(self) -> None:
        if isinstance(self._buckets, RedisBuckets):
            await self._buckets.aclose()


def parse_priority(value: object, levels: int, where: str = PRIORITY) -> int | None:
    """A priority as a request gave it (a header's text, a JSON or protobuf integer), checked
    against the levels; None for none asked (absent, or 0 as Triton's clients send it).

    >>> parse_priority("2", 3), parse_priority(0, 3), parse_priority(None, 3)
    (2, None, None)
    >>> parse_priority("\u00b2", 3, "p")  # a superscript two: a digit to str.isdigit
    Traceback (most recent call last):
    app.errors.InvalidParameter: p must be an integer from 1 to 3 (1 is the highest), got '²'
    >>> parse_priority("high", 3, "p")
    Traceback (most recent call last):
    app.errors.InvalidParameter: p must be an integer from 1 to 3 (1 is the highest), got 'high'
    """
    if value is None:
        return None
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"[0-9]{1,9}", value.strip()):
        number = int(value)
    if number == 0:
        return None
    if number is None or not 1 <= number <= levels:
        shown = value[:20] if isinstance(value, str) else value
        raise InvalidParameter(
            f"{where} must be an integer from 1 to {levels} (1 is the highest), got {shown!r}"
        )
    return number


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()
