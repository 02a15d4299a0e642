"""The job's own certificates: unless mutual TLS is given, a throwaway CA whose key is never written
and one certificate it signed, in a private temporary directory removed when the launcher ends (one
left by a launcher that was SIGKILLed is swept by the next)."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from meshkit.distributed import MutualTLS
from meshkit.launch._errors import LaunchError

#: Prefix of the private directory holding a job's certificates (followed by the launcher's pid).
_TLS_PREFIX = "meshkit-launch-"


@contextlib.contextmanager
def _job_tls(given: MutualTLS | None) -> Iterator[MutualTLS]:
    """``given``, or a CA and certificate made for this job, in a directory only this user can read,
    removed on leaving (one left by a launcher that was SIGKILLed is removed by the next)."""
    if given is not None:
        yield given
        return
    _sweep_stale_tls()
    try:
        directory = tempfile.mkdtemp(prefix=f"{_TLS_PREFIX}{os.getpid()}-")  # mode 0700
    except OSError as e:
        raise LaunchError(
            f"cannot make the job's certificates in {tempfile.gettempdir()} ({e.strerror or e}): set TMPDIR to a "
            "writable directory, or give your own with --mtls-cert/--mtls-key/--mtls-ca"
        ) from None
    try:
        yield _make_tls(Path(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _make_tls(directory: Path) -> MutualTLS:
    """A CA whose key is never written and one certificate it signed, for every process of the job:
    server (process 0's coordination service, checked against the coordinator address's host,
    ``localhost``) and client (every process)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshkit launch {os.getpid()} job CA")])

    def signed(subject: x509.Name, public_key, extensions) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=3650))  # the job's length: the CA dies with it
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(ca_key, hashes.SHA256())

    usage = dict.fromkeys(
        (
            "content_commitment",
            "key_encipherment",
            "data_encipherment",
            "key_agreement",
            "encipher_only",
            "decipher_only",
        ),
        False,
    )
    ca = signed(
        ca_name,
        ca_key.public_key(),
        [
            (x509.BasicConstraints(ca=True, path_length=0), True),
            (x509.KeyUsage(digital_signature=False, key_cert_sign=True, crl_sign=True, **usage), True),
        ],
    )
    host = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    names = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    cert = signed(
        host,
        key.public_key(),
        [
            (x509.BasicConstraints(ca=False, path_length=None), True),
            (x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, **usage), True),
            (
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                False,
            ),
            (x509.SubjectAlternativeName(names), False),
        ],
    )
    pem = serialization.Encoding.PEM
    files = {
        "ca.pem": ca.public_bytes(pem),
        "job.pem": cert.public_bytes(pem),
        "job.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    }
    for name, data in files.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return MutualTLS(
        cert=str(directory / "job.pem"), key=str(directory / "job.key"), ca=str(directory / "ca.pem")
    )


def _sweep_stale_tls() -> None:
    """Remove this user's job certificate directories whose launcher is gone (SIGKILLed)."""
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for d in root.glob(f"{_TLS_PREFIX}*-*"):
            pid = d.name[len(_TLS_PREFIX) :].partition("-")[0]
            with contextlib.suppress(OSError, ValueError):
                if d.stat().st_uid == os.getuid() and not _pid_alive(int(pid)):
                    shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
