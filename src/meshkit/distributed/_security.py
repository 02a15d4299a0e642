"""Who may join a job: where process 0's coordination service listens (``bind_address``) and the
certificates with which the service and every process prove themselves (:class:`MutualTLS`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from meshkit.distributed._env import (
    MESHKIT_COORDINATOR_BIND_ADDRESS,
    MESHKIT_MTLS_CA,
    MESHKIT_MTLS_CERT,
    MESHKIT_MTLS_KEY,
)
from meshkit.distributed._failure import DistributedError


@dataclass(frozen=True, kw_only=True, slots=True)
class MutualTLS:
    """Mutual TLS for the coordination service: each process presents ``cert`` (with ``key``) and
    accepts only peers whose certificates ``ca`` signed. Clients check the coordinator's certificate
    against the host of the coordinator address (e.g. a DNS:localhost entry under ``meshkit launch``)."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MutualTLS | None:
        """From ``MESHKIT_MTLS_CERT/KEY/CA`` (all three, or none: None)."""
        env = os.environ if env is None else env
        names = (MESHKIT_MTLS_CERT, MESHKIT_MTLS_KEY, MESHKIT_MTLS_CA)
        values = [env.get(n) or None for n in names]
        if not any(values):
            return None
        if not all(values):
            missing = ", ".join(n for n, v in zip(names, values, strict=True) if not v)
            raise DistributedError(f"mutual TLS needs a certificate, its key and the CA: set {missing} too")
        return cls(cert=values[0], key=values[1], ca=values[2])

    def check(self) -> None:
        """Raise :class:`DistributedError` unless every file can be read."""
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA bundle", self.ca)):
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise DistributedError(
                    f"cannot read the mutual-TLS {what} '{path}' ({e.strerror or e}): fix the path "
                    f"(--mtls-cert/--mtls-key/--mtls-ca or {MESHKIT_MTLS_CERT}/KEY/CA)"
                ) from None

    def env(self) -> dict[str, str]:
        return {MESHKIT_MTLS_CERT: self.cert, MESHKIT_MTLS_KEY: self.key, MESHKIT_MTLS_CA: self.ca}

    def jax_kwargs(self) -> dict[str, str]:
        return {"mtls_cert_file": self.cert, "mtls_key_file": self.key, "mtls_ca_file": self.ca}


def bind_address(bind: str | None, coordinator: str | None) -> str | None:
    """``bind`` as JAX takes it ('host:port'); a bare host (``127.0.0.1``, ``::1``, ``[::1]``) gets
    the coordinator's port. None stays None (JAX binds every interface)."""
    if bind is None or bind.strip() == "":
        return None
    bind = bind.strip()
    host, sep, port = bind.rpartition(":")
    bracketed = bind.startswith("[") and bind.endswith("]")
    if sep and port.isdigit() and (host.startswith("[") or ":" not in host) and host:
        if not 0 < int(port) < 65536:
            raise DistributedError(f"coordinator bind address {bind!r}: port {port} is not in 1..65535")
        return bind
    if not sep or bracketed or bind.count(":") > 1:  # a bare host name, IPv4 or IPv6 address
        if coordinator is None:
            raise DistributedError(
                f"coordinator bind address {bind!r} has no port and the coordinator's is unknown: give 'host:port'"
            )
        host = bind if bracketed or ":" not in bind else f"[{bind}]"
        return f"{host}:{coordinator.rpartition(':')[2]}"
    raise DistributedError(
        f"coordinator bind address {bind!r} is not 'host:port' or 'host' (e.g. 127.0.0.1:12355, [::1], 10.0.0.5): "
        f"fix --coordinator-bind-address or {MESHKIT_COORDINATOR_BIND_ADDRESS}"
    )
