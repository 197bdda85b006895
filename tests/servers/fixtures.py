"""pytest fixtures for the local S3 (moto) and the local Hugging Face Hub.

Use them from a test module with ``pytest_plugins = ["servers.fixtures"]``.

* ``moto_server`` (session): a ``python -m moto.server`` subprocess on a free port, killed at the end.
* ``s3_bucket``: points boto3 / s3fs at it through the environment (``AWS_ENDPOINT_URL_S3``,
  ``AWS_ENDPOINT_URL`` and test credentials, via monkeypatch, so subprocesses inherit them) and
  creates a fresh bucket; returns its name.
* ``hub_server`` (session): the local Hub of :mod:`servers.hub_server`, on a thread.
* ``hub``: that server, emptied, with this process pointed at it (environment for subprocesses,
  and the constants of an already imported ``huggingface_hub``, which reads them at import).
  ``HubServer.client_env`` gives the environment for a subprocess that downloads from it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .hub_server import HubServer
from .moto_server import MotoServer


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with MotoServer(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def s3_bucket(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    for key, value in moto_server.env().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for key in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):  # never the developer's real profiles
        monkeypatch.setenv(key, os.devnull)
    import boto3

    name = f"test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_server.url, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(tmp_path_factory.mktemp("hub")) as server:
        yield server


@pytest.fixture
def hub(hub_server: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    hub_server.reset()
    for key, value in hub_server.client_env(tmp_path / "hf-home").items():
        monkeypatch.setenv(key, value)
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "ENDPOINT", hub_server.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub_server.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # the module-level HfApi behind huggingface_hub.create_repo & co. read ENDPOINT when it was built
    # (at import): older transformers (5.3's init_hf_repo) call those functions
    import huggingface_hub.hf_api as hf_api

    monkeypatch.setattr(hf_api.api, "endpoint", hub_server.url)
    return hub_server
