"""The tenant of the request being served: a hash of the API key it was authorized with (``""`` without a
key). :class:`~llamaspec.server.middleware.GuardMiddleware` sets it; :func:`llamaspec.server.pipeline.submit`
hands it to ``Engine.submit(owner=...)``, so the shared n-gram pool drafts a request only from its own
tenant's text (``--spec-pool-shared``: from everyone's). Only the hash travels, never the key.

>>> tenant_of(b"secret") == tenant_of(b"secret"), tenant_of(b"a") == tenant_of(b"b"), len(tenant_of(b"a"))
(True, False, 16)
"""
from __future__ import annotations

import hashlib
from contextvars import ContextVar

__all__ = ["TENANT", "tenant_of", "current_tenant"]

#: the tenant of the request this task serves (worker threads inherit it: anyio copies the context)
TENANT: ContextVar[str] = ContextVar("llamaspec_tenant", default="")


def tenant_of(key: bytes) -> str:
    """The tenant id of an API key: 16 hex digits of its SHA-256."""
    return hashlib.sha256(key).hexdigest()[:16]


def current_tenant() -> str:
    return TENANT.get()
