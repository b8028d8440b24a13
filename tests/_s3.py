"""An S3 API server on 127.0.0.1 for the tests: moto's standalone server (``moto[server]``), in this process.

``s3_server`` is a module-scoped fixture (import it into a test module: ``from _s3 import s3_server``), so its
listening socket and threads exist before the per-test leak check's first snapshot. Clients read through s3fs
with ``server.storage_options``; each test makes its own bucket (``server.bucket()``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

CREDENTIALS = {"key": "x", "secret": "x"}  # moto accepts any; s3fs must not look for real ones


@dataclass
class S3Server:
    endpoint: str
    _names: Iterator[int] = field(default_factory=itertools.count)

    @property
    def storage_options(self) -> dict:
        """What fsspec/s3fs needs to reach this server (``storage_options=`` of fastfeed's readers)."""
        return {**CREDENTIALS, "client_kwargs": {"endpoint_url": self.endpoint}}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="x", aws_secret_access_key="x")  # fmt: skip

    def bucket(self, files: dict[str, bytes] | None = None) -> str:
        """A new, empty bucket holding ``files`` ({key: bytes}); its name."""
        name = f"bucket-{next(self._names)}"
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
            for key, data in (files or {}).items():
                client.put_object(Bucket=name, Key=key, Body=data)
        finally:
            client.close()
        return name


@contextlib.contextmanager
def moto_s3() -> Iterator[S3Server]:
    """moto's S3 server on a free port of 127.0.0.1, stopped (listener closed) on leaving."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()
        server._server.server_close()  # stop() only stops serving; this closes the listening socket


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the module's tests; also starts fsspec's event-loop thread (kept for the life of
    the process) so that it does not read as a leak of the first test to use s3fs."""
    pytest.importorskip("moto.server", reason="the S3 tests need moto[server]")
    pytest.importorskip("s3fs", reason="the S3 tests need s3fs (the [remote] extra)")
    import fsspec.asyn

    fsspec.asyn.get_loop()
    with moto_s3() as server:
        yield server
