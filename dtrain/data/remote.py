"""Remote token stores that fail fast and say why: the TensorStore context a store is opened with, and the cause
read out of TensorStore's error text.

TensorStore retries a failed request for a long time on its own (over two minutes for an ``s3://`` store with
no credentials), and its error text holds the cause after a status and before bracketed details. A store is
therefore opened with a context (:func:`context`) that caps the retries of the ``http``, ``s3`` and ``gcs``
drivers at :data:`MAX_RETRIES`, with short delays, so that an unresolvable host, a refused port, a missing
credential or a denied request is an error within a second or two; ``data.read_timeout_s`` still bounds each read
of a store that answers slowly. :func:`explain` turns the error text into one line naming the cause.

S3 credentials: the AWS default chain logs every place it looked to stderr (C++ lines a Python program cannot
silence) and, off AWS, asks the EC2 metadata address. The chain is used only where it can find something
(:func:`aws_credentials`): keys in the environment, a profile or an ``~/.aws`` file, a container or web-identity
credential, or an EC2 instance; with none of them a request is made without credentials (anonymous), and an
access denied then says that no credentials were found.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MAX_RETRIES = 2  # retries of one request by TensorStore's http, s3 and gcs drivers (its defaults retry for minutes)
RETRY_DELAY = {"initial_delay": "100ms", "max_delay": "1s"}
CONNECT_TIMEOUT_S = "5"  # TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS unless set: a host that drops packets
AWS_KEY_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
AWS_CHAIN_ENV = ("AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")
EC2_MARKERS = (("/sys/devices/virtual/dmi/id/sys_vendor", "Amazon EC2"), ("/sys/hypervisor/uuid", "ec2"),
               ("/sys/devices/virtual/dmi/id/board_asset_tag", "i-"))
GCS_CREDENTIAL_ENV = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_AUTH_TOKEN_FOR_TESTING")


def on_ec2() -> bool:
    """Whether this machine says it is an EC2 instance (its DMI vendor or hypervisor id, :data:`EC2_MARKERS`; no
    network)."""
    for path, prefix in EC2_MARKERS:
        try:
            if Path(path).read_text(errors="replace").strip().startswith(prefix):
                return True
        except OSError:
            continue
    return False


def aws_credentials(env: Mapping[str, str], home: Path, ec2: bool) -> str:
    """The TensorStore ``aws_credentials`` type to open an ``s3://`` store with: ``environment`` with both keys in
    ``env``; ``default`` (the AWS chain) with a profile, an ``~/.aws`` file or a container or web-identity
    credential; ``imds`` on an EC2 instance with none of those; else ``anonymous`` (no credentials anywhere)."""
    if all(env.get(k) for k in AWS_KEY_ENV):
        return "environment"
    if any(env.get(k) for k in AWS_CHAIN_ENV) or (home / ".aws" / "credentials").exists() \
            or (home / ".aws" / "config").exists():
        return "default"
    return "imds" if ec2 else "anonymous"


def gcs_credentials_found(env: Mapping[str, str], home: Path) -> bool:
    """Whether a Google credential is configured here: an environment variable or gcloud's default file."""
    config = Path(env["CLOUDSDK_CONFIG"]) if env.get("CLOUDSDK_CONFIG") else home / ".config" / "gcloud"
    return any(env.get(k) for k in GCS_CREDENTIAL_ENV) or (config / "application_default_credentials.json").exists()


def context_spec(kv: Mapping[str, Any], env: Mapping[str, str] | None = None, home: Path | None = None,
                 ec2: bool | None = None) -> dict[str, Any]:
    """The context spec a store at kvstore ``kv`` is opened with: retries capped for its driver (and, for s3,
    the credentials :func:`aws_credentials` picks). Empty for a local store."""
    retries = {"max_retries": MAX_RETRIES, **RETRY_DELAY}
    driver = kv["driver"]
    if driver == "http":
        return {"http_request_retries": retries}
    if driver == "gcs":
        return {"gcs_request_retries": retries}
    if driver == "s3":
        env = os.environ if env is None else env
        kind = aws_credentials(env, Path.home() if home is None else home, on_ec2() if ec2 is None else ec2)
        return {"s3_request_retries": retries, "aws_credentials": {"type": kind}}
    return {}


def context(kv: Mapping[str, Any]) -> Any:
    """A TensorStore context for a store at kvstore ``kv`` (:func:`context_spec`); None for a local store. The
    first remote one also bounds curl's connect wait (``TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS``, unless set)."""
    import tensorstore as ts

    spec = context_spec(kv)
    if not spec:
        return None
    os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", CONNECT_TIMEOUT_S)
    return ts.Context(spec)


_RESOLVE = re.compile(r"Could not resolve host:? ([^\s\[\]'\"]+)")
_CONNECT = re.compile(r"Failed to connect to (\S+) port (\d+)")
_HTTP_CODE = re.compile(r"(?:\[HTTP code |http_response_code=')(\d{3})")
_S3_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_STATUS = re.compile(r"^[A-Z_]+: ")
_DETAILS = re.compile(r"\s*\[[a-z_]+='.*$|\s*\[HTTP code \d+\].*$", re.S)


def _no_credentials(scheme: str, env: Mapping[str, str], home: Path, ec2: bool) -> str:
    if scheme == "s3" and aws_credentials(env, home, ec2) == "anonymous":
        return ("; no AWS credentials were found, so the request was anonymous: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
    if scheme == "gs" and not gcs_credentials_found(env, home):
        return ("; no Google credentials were found: set GOOGLE_APPLICATION_CREDENTIALS, or run gcloud auth "
                "application-default login")
    return ""


def explain(location: str, error: str, env: Mapping[str, str] | None = None, home: Path | None = None,
            ec2: bool | None = None) -> str:
    """The cause in TensorStore's error text ``error`` about the store at ``location``, in words: a host that does
    not resolve, a refused connection, a timeout, access denied (with what credentials were missing), not
    authenticated; else the text without its status prefix and bracketed details."""
    env = os.environ if env is None else env
    home = Path.home() if home is None else home
    scheme = location.split("://", 1)[0] if "://" in location else "file"
    text = " ".join(error.split())
    if m := _RESOLVE.search(text):
        return f"cannot resolve the host {m.group(1)} (check the URL's host name, and DNS from here)"
    if "curl_code='28'" in text or "Connection timed out" in text or "Timeout was reached" in text:
        return "no answer while connecting (a firewall, or a host that is down?)"
    if m := _CONNECT.search(text):
        return (f"cannot connect to {m.group(1)} port {m.group(2)}: refused (nothing listens there) or no route "
                "to it")
    code = int(m.group(1)) if (m := _HTTP_CODE.search(text)) else 0
    s3 = f", {m.group(1)}" if (m := _S3_CODE.search(text)) else ""
    if code == 403 or text.startswith("PERMISSION_DENIED"):
        hint = _no_credentials(scheme, env, home, on_ec2() if ec2 is None else ec2)
        return f"access denied (HTTP 403{s3}){hint or ': check the credentials and the bucket policy'}"
    if code == 401 or text.startswith("UNAUTHENTICATED"):
        hint = _no_credentials(scheme, env, home, on_ec2() if ec2 is None else ec2)
        return f"not authenticated (HTTP 401{s3}){hint or ': check the credentials'}"
    if code == 404 or text.startswith("NOT_FOUND"):
        return f"not found (HTTP 404{s3}): check the bucket and the path"
    if "curl_code='60'" in text or "SSL" in text or "certificate" in text:
        return f"TLS failed: {_DETAILS.sub('', _STATUS.sub('', text))}"
    return _DETAILS.sub("", _STATUS.sub("", text)) or text
