"""The temporary Prefect server's database is as private as a run directory (issue 62 item 7)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from conftest import ROOT
from cli_probe import child_pythonpath


def test_the_temporary_servers_database_is_0600_in_a_0700_home_whatever_the_umask(tmp_path):
    """It holds the run's logs and artifacts: SQLite made it 0644 under a 0755 PREFECT_HOME,
    while the run directory is 0700 and its files 0600. The server is started as `dpdistill
    run` starts it (`EarlyServer`), on a new PREFECT_HOME, under umask 022, and writes a log."""
    probe = """if True:
        import os
        os.umask(0o022)
        import flows
        import prefect.main
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import VariableCreate
        from prefect.server.api.server import SubprocessASGIServer
        from flows.cli_run import EarlyServer
        early = EarlyServer()
        early.start()
        early.wait()
        with get_client(sync_client=True) as client:
            client.create_variable(VariableCreate(name="written", value="a row"))
        SubprocessASGIServer().stop()
    """
    home = tmp_path / "prefect_home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(home), "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    files = [f for f in home.iterdir() if f.name.startswith("prefect.db")]
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), {
        f.name: oct(f.stat().st_mode) for f in files}
