"""A local S3 endpoint for the tests: moto's standalone server, run as a subprocess on 127.0.0.1.

    server = LocalS3()                      # starts it, returns once it answers HTTP
    bucket = server.new_bucket()            # a fresh, uniquely named bucket
    fs = s3fs.S3FileSystem(**server.storage_options, skip_instance_cache=True)
    fs.pipe_file(f"{bucket}/key", b"...")
    server.stop()

Nothing here reaches beyond 127.0.0.1: the server gets fake credentials and region
us-east-1, no proxy settings and no AWS configuration of the calling environment; the test
process gets `AWS_EC2_METADATA_DISABLED=true` (botocore never asks the EC2 instance
metadata service for credentials or region) and 127.0.0.1 added to `NO_PROXY`.

Caching, which matters whenever a test relies on a fresh view of the bucket:

* s3fs keeps one `S3FileSystem` per distinct set of arguments (fsspec's instance cache), so
  `S3FileSystem(**storage_options)` in two places returns the *same* object, with the same
  directory listing cache (`fs.ls` results are cached per instance). Pass
  `skip_instance_cache=True` to get a new instance, or call
  `s3fs.S3FileSystem.clear_instance_cache()`; `fs.invalidate_cache()` drops one instance's
  listings.
* s3fs runs its coroutines on fsspec's shared IO event loop (a daemon thread of the test
  process); instances hold aiobotocore clients bound to that loop. Do not carry an instance
  across `fork` (a forked child must make its own, with `skip_instance_cache=True`).
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from typing import IO, Any

from shardwise.testing import free_port

REGION = "us-east-1"
KEY = SECRET = "testing"
STARTUP_DEADLINE_S = 20.0
_ATTEMPTS = 3  # a new port each time the server exits early because its port was taken


def _isolate_test_process() -> None:
    """Keep s3fs/botocore in this process off AWS metadata services and off proxies."""
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    for name in ("NO_PROXY", "no_proxy"):
        hosts = [h for h in os.environ.get(name, "").split(",") if h.strip()]
        if "127.0.0.1" not in hosts:
            os.environ[name] = ",".join([*hosts, "127.0.0.1"])


def client_env() -> dict[str, str]:
    """This process's environment for a process that talks to the local server: its
    credentials, as boto finds them, and nothing else of this machine's AWS or proxy
    settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(("AWS_", "MOTO_")) and not k.lower().endswith("_proxy")
    }
    env.update(
        AWS_ACCESS_KEY_ID=KEY,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION=REGION,
        AWS_REGION=REGION,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        NO_PROXY="*",
        no_proxy="*",
    )
    return env


def _server_env() -> dict[str, str]:
    return {**client_env(), "PYTHONUNBUFFERED": "1"}


def _answers(port: int) -> bool:
    """Whether something on 127.0.0.1:port answers an HTTP GET (any status will do)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=0.5)
    try:
        conn.request("GET", "/moto-api/data.json")
        conn.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _tail(log: IO[bytes], limit: int = 4000) -> str:
    try:
        log.flush()
        log.seek(0)
        text = log.read().decode(errors="replace")
    except (OSError, ValueError):
        return "<log unavailable>"
    return text[-limit:] if text else "<empty>"


def _stop(proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
    finally:
        log.close()


class LocalS3:
    """moto's S3 server on a free port of 127.0.0.1, started on construction.

    `endpoint` is its URL, `storage_options` the s3fs arguments that reach it,
    `startup_s` how long it took to answer. `stop()` ends it (also a context manager).
    See the module docstring on s3fs's instance cache: pass `skip_instance_cache=True` to
    `S3FileSystem` (or call `S3FileSystem.clear_instance_cache()`) where a fresh view matters.
    """

    def __init__(self, deadline_s: float = STARTUP_DEADLINE_S) -> None:
        _isolate_test_process()
        for attempt in range(_ATTEMPTS):
            port = free_port()
            log = tempfile.TemporaryFile(prefix="moto-s3-")
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_server_env(),
            )
            # Ends the server if this object is dropped or the interpreter exits unstopped.
            self._finalizer = weakref.finalize(self, _stop, proc, log)
            while True:
                if proc.poll() is not None:
                    tail = _tail(log)
                    self._finalizer()
                    if "address already in use" in tail.lower() and attempt + 1 < _ATTEMPTS:
                        break  # the port was taken between free_port() and bind: next one
                    raise RuntimeError(
                        f"moto S3 server on 127.0.0.1:{port} exited with {proc.returncode} "
                        f"before answering; its output ends with:\n{tail}"
                    )
                if _answers(port):
                    self.startup_s = time.monotonic() - start
                    self.port = port
                    self.endpoint = f"http://127.0.0.1:{port}"
                    self._proc = proc
                    return
                if time.monotonic() - start > deadline_s:
                    tail = _tail(log)
                    self._finalizer()
                    raise RuntimeError(
                        f"moto S3 server on 127.0.0.1:{port} did not answer within "
                        f"{deadline_s:.0f} s; its output ends with:\n{tail}"
                    )
                time.sleep(0.05)

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs arguments for this server (a new dict each time: mutate freely)."""
        return {
            "endpoint_url": self.endpoint,
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"region_name": REGION},
        }

    @property
    def running(self) -> bool:
        return self._finalizer.alive and self._proc.poll() is None

    def new_bucket(self, prefix: str = "t") -> str:
        """Create a bucket named `<prefix>-<random>` and return its name (no `s3://`)."""
        import s3fs

        name = f"{prefix.lower()}-{uuid.uuid4().hex[:16]}"
        fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
        # Not fs.mkdir(name): with region_name in client_kwargs s3fs sends
        # LocationConstraint=us-east-1, which S3 (and moto) reject for us-east-1.
        fs.call_s3("create_bucket", Bucket=name)
        return name

    def stop(self) -> None:
        """Terminate the server (SIGTERM, 5 s, then SIGKILL). Idempotent."""
        self._finalizer()

    def __enter__(self) -> LocalS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
