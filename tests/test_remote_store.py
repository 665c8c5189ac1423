"""dtrain.data.remote: a remote token store that cannot be read fails within seconds, naming the cause.

Nothing here leaves the machine: every store is on 127.0.0.1 (a closed port, or a small HTTP server in the test
that answers 403 or does not answer), s3:// and gs:// are pointed there (AWS_ENDPOINT_URL,
TENSORSTORE_GCS_HTTP_URL), and no credential lookup may reach a metadata address (no EC2 markers, no
credential files: HOME is an empty folder); the host that does not resolve is looked up in a network namespace
with no way out. Each open is given 30 s: the messages below are the cause, not the
timeout's, so each came back long before it (uncapped, TensorStore retries for minutes).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.data import remote
from dtrain.data.token_store import StoreError, TokenStore, kvstore_spec

WAIT_S = 30.0  # far longer than a capped failure takes; the uncapped retries take minutes


class _Answer(http.server.BaseHTTPRequestHandler):
    """Every request: 403 with an S3-style error body, or (``slow``) no answer until the test ends."""

    slow: threading.Event | None = None

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        if self.slow is not None:
            self.slow.wait(WAIT_S)
            return
        body = b"<?xml version='1.0'?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def _serve(slow: threading.Event | None) -> Iterator[str]:
    handler = type("Handler", (_Answer,), {"slow": slow})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if slow is not None:
            slow.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def denied() -> Iterator[str]:
    """A server on 127.0.0.1 that answers every request 403 Access Denied."""
    yield from _serve(None)


@pytest.fixture
def slow() -> Iterator[str]:
    """A server on 127.0.0.1 that accepts connections and never answers."""
    yield from _serve(threading.Event())


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS or Google credential anywhere, and not an EC2 instance: no lookup may leave the machine."""
    for name in (*remote.AWS_KEY_ENV, *remote.AWS_CHAIN_ENV, *remote.GCS_CREDENTIAL_ENV, "CLOUDSDK_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(remote, "EC2_MARKERS", ())


def _closed_port() -> int:
    with socket.socket() as s:  # a port that was free a moment ago, and is closed now
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_port_is_named_at_once() -> None:
    port = _closed_port()
    with pytest.raises(StoreError) as e:
        TokenStore.open(f"http://127.0.0.1:{port}/store", timeout_s=WAIT_S)
    assert str(e.value) == (f"token store http://127.0.0.1:{port}/store: reading its manifest.json failed: cannot "
                            f"connect to 127.0.0.1 port {port}: refused (nothing listens there) or no route to it")


def test_denied_access_over_http_is_named(denied: str) -> None:
    with pytest.raises(StoreError, match=r"store: reading its manifest.json failed: access denied \(HTTP 403, "
                                         r"AccessDenied\): check the credentials and the bucket policy$"):
        TokenStore.open(f"{denied}/store", timeout_s=WAIT_S)


def test_s3_without_credentials_says_so(denied: str, no_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", denied)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(StoreError) as e:
        TokenStore.open("s3://dtrain-test/store", timeout_s=WAIT_S)
    assert str(e.value) == ("token store s3://dtrain-test/store: reading its manifest.json failed: access denied "
                            "(HTTP 403, AccessDenied); no AWS credentials were found, so the request was "
                            "anonymous: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")


def test_s3_with_credentials_denied_names_the_code(denied: str, no_credentials: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", denied)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    with pytest.raises(StoreError, match=r"access denied \(HTTP 403, AccessDenied\): check the credentials"):
        TokenStore.open("s3://dtrain-test/store", timeout_s=WAIT_S)


def test_gs_denied_is_named(denied: str, no_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "not-a-real-token")  # no credential lookup at all
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", denied)
    with pytest.raises(StoreError, match=r"gs://dtrain-test/store: reading its manifest.json failed: access "
                                         r"denied \(HTTP 403, AccessDenied\): check the credentials"):
        TokenStore.open("gs://dtrain-test/store", timeout_s=WAIT_S)


def test_a_store_that_answers_slowly_waits_read_timeout_s(slow: str) -> None:
    with pytest.raises(StoreError, match=r"store did not answer within 1 s \(reading its manifest.json\): check "
                                         r"the address and that it is reachable from here$"):
        TokenStore.open(f"{slow}/store", timeout_s=1)


ROOT = Path(__file__).resolve().parent.parent
OPEN_EACH = """
import json, sys, time
from dtrain.data.token_store import StoreError, TokenStore
for location in sys.argv[1:]:
    t0 = time.monotonic()
    try:
        TokenStore.open(location, timeout_s=60)
        message = "opened"
    except StoreError as e:
        message = str(e)
    print(json.dumps([location, message, time.monotonic() - t0]))
"""


def test_a_host_that_does_not_resolve_is_named_within_seconds(tmp_path: Path) -> None:
    """In a network namespace of its own (``unshare -rn``: only a loopback interface, down), nothing can leave
    the machine and no name resolves, whatever this machine's DNS: the resolver cannot reach a server. Each store
    is one line naming the host, well within 10 s (uncapped, TensorStore retried for minutes)."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rn (an unprivileged network namespace) is not allowed on this machine")
    env = {k: v for k, v in os.environ.items()
           if k not in (*remote.AWS_KEY_ENV, *remote.AWS_CHAIN_ENV, *remote.GCS_CREDENTIAL_ENV, "AWS_ENDPOINT_URL",
                        "TENSORSTORE_GCS_HTTP_URL", "CLOUDSDK_CONFIG")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT), GOOGLE_AUTH_TOKEN_FOR_TESTING="not-a-real-token")
    locations = {"http://dtrain-test.invalid/store": "dtrain-test.invalid",
                 "s3://dtrain-test/store": "dtrain-test.s3.amazonaws.com",
                 "gs://dtrain-test/store": "storage.googleapis.com"}
    proc = subprocess.run([unshare, "-rn", sys.executable, "-c", OPEN_EACH, *locations], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r[0] for r in results] == list(locations)
    for location, message, seconds in results:
        assert message == (f"token store {location}: reading its manifest.json failed: cannot resolve the host "
                           f"{locations[location]} (check the URL's host name, and DNS from here)")
        assert seconds < 10, (location, seconds)


def test_the_causes_in_tensorstore_error_text() -> None:
    """The texts TensorStore gives (as seen from its http, s3 and gcs drivers), read as one cause each."""
    env: dict[str, str] = {}
    home = Path("/nonexistent")
    resolve = ("ABORTED: All 2 retry attempts failed: CURL error Could not resolve hostname: Could not resolve host: "
               "my-bucket.s3.amazonaws.com [curl_code='6']")
    assert remote.explain("s3://my-bucket/x", resolve, env, home, False) == (
        "cannot resolve the host my-bucket.s3.amazonaws.com (check the URL's host name, and DNS from here)")
    timeout = ("ABORTED: All 2 retry attempts failed: CURL error Timeout was reached: Failed to connect to 10.0.0.1 "
               "port 80 after 5000 ms: Timeout was reached [curl_code='28']")
    assert remote.explain("http://10.0.0.1/x", timeout, env, home, False).startswith("no answer while connecting")
    gs = "UNAUTHENTICATED: Unauthorized [http_response_body='{}'] [http_response_code='401']"
    assert remote.explain("gs://b/x", gs, env, home, False) == (
        "not authenticated (HTTP 401); no Google credentials were found: set GOOGLE_APPLICATION_CREDENTIALS, or run "
        "gcloud auth application-default login")
    other = "FAILED_PRECONDITION: Something else [http_response_code='409']"
    assert remote.explain("http://h/x", other, env, home, False) == "Something else"


def test_s3_credentials_are_looked_for_only_where_they_can_be(tmp_path: Path) -> None:
    keys = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
    assert remote.aws_credentials(keys, tmp_path, ec2=False) == "environment"
    assert remote.aws_credentials({"AWS_PROFILE": "p"}, tmp_path, ec2=False) == "default"
    assert remote.aws_credentials({}, tmp_path, ec2=True) == "imds"
    assert remote.aws_credentials({}, tmp_path, ec2=False) == "anonymous"
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\n")
    assert remote.aws_credentials({}, tmp_path, ec2=False) == "default"
    spec = remote.context_spec(kvstore_spec("s3://b/x"), env={}, home=tmp_path / "none", ec2=False)
    assert spec["aws_credentials"] == {"type": "anonymous"}
    assert spec["s3_request_retries"]["max_retries"] == remote.MAX_RETRIES
    assert remote.context_spec(kvstore_spec("/tmp/store")) == {}
