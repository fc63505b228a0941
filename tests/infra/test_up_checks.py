"""infra/local/up.sh refuses, in one line and before starting anything, a backend store it cannot
open; the password appears nowhere (neither in the message nor on a command line)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_up_refuses_a_wrong_database_password_in_one_line(tmp_path, postgres_with_password):
    host, port, user, password = postgres_with_password
    home = tmp_path / "home"
    env = {**os.environ, "CEMLAB_HOME": str(home), "VENV_BIN": str(Path(sys.executable).parent),
           "CEMLAB_MLFLOW_BACKEND_URI":
               f"postgresql+psycopg2://{user}:wrong-{password}@{host}:{port}/postgres"}
    up = subprocess.run([str(ROOT / "infra/local/up.sh")], env=env, capture_output=True,
                        text=True, timeout=120)
    assert up.returncode == 2 and up.stdout == ""
    assert up.stderr.strip().splitlines() == [
        f"error: CEMLAB_MLFLOW_BACKEND_URI postgresql+psycopg2://{user}:***@{host}:{port}/"
        f'postgres: password authentication failed for user "{user}"']
    assert password not in up.stderr
    assert not list((home / "run").glob("*.pid")) and not (home / "services.env").exists()
