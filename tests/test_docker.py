"""The container setup, read as files (no Docker engine here): a private server, no private
data in the images."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = re.compile(r"^\$\{(\w+):\?[^}]+\}$")  # ${VAR:?message}: compose refuses to start without it


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def test_server_listens_on_localhost_and_requires_an_auth_string():
    services = _compose()["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    server_env = services["server"]["environment"]
    assert REQUIRED.match(server_env["PREFECT_SERVER_API_AUTH_STRING"]).group(1) == "PREFECT_SERVER_API_AUTH_STRING"
    for name, service in services.items():
        env = service.get("environment", {})
        if env.get("PREFECT_API_URL"):  # a client of the server
            assert REQUIRED.match(env["PREFECT_API_AUTH_STRING"]).group(1) == "PREFECT_SERVER_API_AUTH_STRING", name


def test_no_default_database_password():
    services = _compose()["services"]
    assert REQUIRED.match(services["postgres"]["environment"]["POSTGRES_PASSWORD"])
    url = services["server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert "${POSTGRES_PASSWORD:?" in url and ":-" not in url


def test_images_copy_no_private_data():
    allowed = {"data/README.md", "data/public", "data/yelp_sample"}
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        copies = [line.split()[1:-1] for line in (ROOT / "docker" / dockerfile).read_text().splitlines()
                  if line.startswith(("COPY", "ADD"))]
        sources = [s.rstrip("/") for srcs in copies for s in srcs if not s.startswith("--")]
        data = {s for s in sources if s == "data" or s.startswith("data/") or s in (".", "./")}
        assert data == allowed, f"{dockerfile} copies {sorted(data)}"
    rules = [r.strip() for r in (ROOT / ".dockerignore").read_text().splitlines() if r.strip() and not r.startswith("#")]
    assert "data/*" in rules and "data" not in rules
    assert {r[1:] for r in rules if r.startswith("!data/")} == allowed  # the last match wins
    assert rules.index("data/*") < min(rules.index("!" + a) for a in allowed)


def test_the_optional_dask_cluster_sees_the_flow_s_run_directory():
    """Dask workers load the teacher and write shards by the flow's paths: they mount the run
    directory where the Prefect worker does, and start only with the dask profile."""
    services = _compose()["services"]
    for name in ("dask-scheduler", "dask-worker"):
        assert services[name]["profiles"] == ["dask"]
    assert services["dask-worker"]["volumes"] == services["worker"]["volumes"]
    assert "tcp://dask-scheduler:8786" in services["dask-worker"]["command"]
