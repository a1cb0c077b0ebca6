"""What to tell someone whose TLS connection to the control plane failed on its
certificate: one wording for the agent's dial and the admin CLI."""

from __future__ import annotations

import ssl

# OpenSSL's verify codes for a certificate that is valid but not for the name dialed.
NAME_MISMATCH_CODES = frozenset({62, 64})  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_


def name_mismatch(exc: ssl.SSLCertVerificationError) -> str | None:
    """The advice for a certificate that is trusted but names another host; None when
    `exc` is another verification failure (an untrusted CA, an expired certificate)."""
    if exc.verify_code not in NAME_MISMATCH_CODES:
        return None
    why = exc.verify_message or exc.reason or str(exc)
    return (
        f"name mismatch: the control plane's certificate is not valid for the name "
        f"dialed ({why}): dial a name or address the certificate holds, or make the "
        "server's certificate for it (certs init --host)"
    )


def cert_error(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification error behind `exc` (an httpx or trio error wraps it)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
