"""The Go client's TLS and bearer-token options (clients/go/atomlog/security.go) against a
real cluster: `atomlog up --tls` with auth.mode=mtls_or_token (static tokens) and ACLs;
`go test -tags secured` (clients/go/atomlog/secured_test.go) sends as a principal allowed
to write (a token over mutual TLS), one that is not (a token file), the certificate's own
principal, and over plaintext, and checks Dial's validation of the options; the allowed
and the denied principal also commit a one-call transaction, answered on the
coordinator's link over TLS (clients/go/atomlog/link.go)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from services.acl import Acl
from spark_client import Client
from tests.conftest import ACL_TOKENS, REPO_ROOT, create_online
from tests.go_tools import go_tools
from tests.test_acl import acls, store  # noqa: F401 — the module's ACL entries, removed after
from tests.test_acl import tls_of

pytestmark = pytest.mark.timeout(900)  # a cold Go build takes minutes

TOPIC = "acl-go"
BOB_TOKEN, DAVE_TOKEN = ACL_TOKENS["bob"], ACL_TOKENS["dave"]


@pytest.fixture(scope="module")
def acl_cluster(acl_secured):
    """The suite's secured cluster (conftest.acl_secured: auth.mode=mtls_or_token, static
    tokens ACL_TOKENS) with this module's topic."""
    with Client(acl_secured.info["bootstrap"], tls=tls_of(acl_secured, "admin")) as admin:
        create_online(admin, TOPIC, 1)
    return acl_secured


def test_go_client_tls_and_bearer_tokens_under_acls(acl_cluster, acls, tmp_path):
    acls(Acl("bob", "topic", TOPIC, "write"))
    server_log = Path(acl_cluster.process("ps-0")["log_file"])
    log_start = server_log.stat().st_size  # the cluster is shared: judge this test's lines
    go = go_tools(900)["GO"]
    token_file = tmp_path / "dave.token"
    token_file.write_text(DAVE_TOKEN + "\n")
    tls = tls_of(acl_cluster, "go-client")  # a certificate whose principal has no ACL
    env = {**os.environ, "PATH": f"{Path(go).parent}:{os.environ['PATH']}",
           "ATOMLOG_BOOTSTRAP": acl_cluster.info["bootstrap"], "ATOMLOG_TOPIC": TOPIC,
           "ATOMLOG_TLS_CA": tls.ca_file, "ATOMLOG_TLS_CERT": tls.cert_file,
           "ATOMLOG_TLS_KEY": tls.key_file, "ATOMLOG_TOKEN_ALLOWED": BOB_TOKEN,
           "ATOMLOG_TOKEN_FILE_DENIED": str(token_file)}
    result = subprocess.run([go, "test", "-count=1", "-v", "-tags", "secured", "-run",
                             "TestSecured", "./atomlog/"], cwd=REPO_ROOT / "clients" / "go",
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = {line.split()[2] for line in result.stdout.splitlines() if line.startswith("--- PASS")}
    assert passed == {"TestSecuredTokenOverMutualTLS", "TestSecuredTokenFileWithoutPermission",
                      "TestSecuredCertificatePrincipalWithoutToken",
                      "TestSecuredPlaintextAndBadOptionsAreRefused",
                      "TestSecuredOneCallCommitsOnTheLink"}, result.stdout
    with open(server_log, "rb") as log_file:
        log_file.seek(log_start)
        log = log_file.read().decode()
    denied = [json.loads(line) for line in log.splitlines() if '"permission denied"' in line]
    assert {"dave", "go-client"} <= {entry["principal"] for entry in denied}
