"""Reachability checks against real servers: a PostgreSQL with password authentication, a
closed port, a live HTTP server."""

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.conftest import free_port
from workloads.core.reach import (
    ServiceError,
    check_database,
    check_tracking,
    is_loopback,
    node_only,
)


@pytest.mark.parametrize("uri, loopback, only_here", [
    ("http://127.0.0.1:5000", True, True),
    ("http://localhost:5000", True, True),
    ("http://[::1]:5000", True, True),
    ("http://10.0.0.2:5000", False, False),
    ("http://mlflow.internal:5000", False, False),
    ("postgresql://u:p@127.0.0.1:5432/db", True, True),
    ("postgresql://u:p@db.internal:5432/db", False, False),
    ("sqlite:////home/me/.cemlab/mlflow.db", False, True),
    ("/home/me/.cemlab", False, True),
    ("s3://bucket/lab", False, False),
])
def test_loopback_and_host_only_uris(uri, loopback, only_here):
    assert is_loopback(uri) is loopback
    assert node_only(uri) is only_here


def test_a_wrong_database_password_is_one_line_without_the_password(postgres_with_password):
    host, port, user, password = postgres_with_password
    check_database(f"postgresql+psycopg2://{user}:{password}@{host}:{port}/postgres", "X_URL")
    wrong = "not-" + password
    with pytest.raises(ServiceError) as e:
        check_database(f"postgresql+psycopg2://{user}:{wrong}@{host}:{port}/postgres",
                       "CEMLAB_LEDGER_URL")
    message = str(e.value)
    assert message == (f"CEMLAB_LEDGER_URL postgresql+psycopg2://{user}:***@{host}:{port}/"
                       f'postgres: password authentication failed for user "{user}"')
    assert password not in message and wrong not in message


def test_an_unreachable_database_or_tracking_server_is_one_line():
    port = free_port()
    with pytest.raises(ServiceError) as db:
        check_database(f"postgresql+psycopg2://u:pw@127.0.0.1:{port}/x", "CEMLAB_LEDGER_URL")
    assert "\n" not in str(db.value) and "Connection refused" in str(db.value)
    assert ":pw@" not in str(db.value)
    with pytest.raises(ServiceError) as http:
        check_tracking(f"http://127.0.0.1:{port}", where="10.0.0.2")
    assert str(http.value) == (f"MLFLOW_TRACKING_URI http://127.0.0.1:{port}: no answer from "
                               "node 10.0.0.2 (Connection refused)")


def test_a_live_tracking_server_passes_and_an_http_error_is_named():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/ok/health" else 403)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        check_tracking(f"{base}/ok")
        with pytest.raises(ServiceError) as e:
            check_tracking(f"{base}/denied")
        assert str(e.value) == f"MLFLOW_TRACKING_URI {base}/denied: HTTP 403 Forbidden"
    finally:
        server.shutdown()
