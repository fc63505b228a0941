"""Can this node reach the services a trial needs? Checked before anything trains.

A trial needs its MLflow tracking server (every Ray Train worker logs to it) and, on the driver,
the ledger's database. Each check raises ``ServiceError``, whose ``str()`` is one line naming
the setting and the cause; a database password is never part of it.
"""

from __future__ import annotations

import ipaddress
import urllib.error
import urllib.request
from urllib.parse import urlsplit


class ServiceError(RuntimeError):
    """A service that cannot be used; ``str()`` is one line naming the setting and the cause."""


def is_loopback(uri: str) -> bool:
    """Whether ``uri``'s host (a URL or SQLAlchemy URL; a file or SQLite path has none) is this
    machine's loopback: ``localhost``, ``127.0.0.0/8``, ``::1``."""
    host = urlsplit(uri).hostname
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_only(uri: str) -> bool:
    """Whether ``uri`` only works on the machine that wrote it: a loopback host, a file path or
    a SQLite file (``sqlite:///...``)."""
    scheme = urlsplit(uri).scheme
    return is_loopback(uri) or scheme in ("", "file") or scheme.startswith("sqlite")


def check_tracking(uri: str, setting: str = "MLFLOW_TRACKING_URI", where: str = "",
                   timeout_s: float = 5.0) -> None:
    """Ask the MLflow server at ``uri`` (``http(s)://``) for its ``/health``; other URIs (a
    database or file store) are left to MLflow.

    Raises:
        ServiceError: no answer within ``timeout_s`` or an HTTP error, e.g. ``MLFLOW_TRACKING_URI
            http://127.0.0.1:5000: no answer from node 10.0.0.2 (Connection refused)``.
    """
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s).close()
    except urllib.error.HTTPError as e:
        raise ServiceError(f"{setting} {uri}: HTTP {e.code} {e.reason}"
                           f"{' from node ' + where if where else ''}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        reason = getattr(reason, "strerror", None) or str(reason)
        raise ServiceError(f"{setting} {uri}: no answer"
                           f"{' from node ' + where if where else ''} ({reason})") from None


def check_database(url: str, setting: str, timeout_s: int = 5) -> None:
    """Open and close one connection to the SQLAlchemy database ``url``.

    Raises:
        ServiceError: it refuses the connection (wrong password, unknown database, no server),
            e.g. ``CEMLAB_LEDGER_URL postgresql://cemlab:***@db:5432/cemlab: password
            authentication failed for user "cemlab"``; the password is masked.
    """
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError:
        raise ServiceError(f"{setting}: not a database URL") from None
    shown = parsed.render_as_string(hide_password=True)
    args = {"connect_timeout": timeout_s} if parsed.get_backend_name() == "postgresql" else {}
    engine = sa.create_engine(parsed, connect_args=args, poolclass=sa.pool.NullPool)
    try:
        with engine.connect():
            pass
    except sa.exc.DBAPIError as e:
        lines = [ln.strip() for ln in str(e.orig).splitlines() if ln.strip()]
        reason = lines[0] if lines else type(e.orig).__name__
        if parsed.password:
            reason = reason.replace(str(parsed.password), "***")
        reason = reason.split("FATAL:", 1)[-1].strip()
        raise ServiceError(f"{setting} {shown}: {reason}") from None
    except sa.exc.NoSuchModuleError as e:
        raise ServiceError(f"{setting} {shown}: {e}") from None
    finally:
        engine.dispose()

