"""What importing the SDK costs a process: every Spark Python worker, every client."""

from __future__ import annotations

import subprocess
import sys


def test_the_sdk_brings_no_server_metrics_into_a_client_process():
    """services.auth and services.local, which the SDK imports, import the servers'
    metrics (prometheus_client, http.server, wsgiref: about 40 ms) only where a server
    uses them."""
    code = ("import sys, spark_client, spark_client.spark\n"
            "print(sorted(m for m in ('services.metrics', 'prometheus_client', 'http.server',"
            " 'wsgiref') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_a_server_side_auth_failure_is_still_counted():
    from services import auth, metrics

    counted = metrics.AUTH_FAILURES.labels("test-import")
    before = counted.get()
    auth.record_failure(auth.AuthFailure("test-import", "a test"), "/x/Y", "peer")
    assert counted.get() == before + 1
