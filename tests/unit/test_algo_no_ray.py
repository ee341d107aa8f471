"""ray_ppo.algo must stay importable without Ray or transformers (pure torch components)."""

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_importing_algo_does_not_import_ray_or_transformers():
    code = "import ray_ppo.algo, sys; assert 'ray' not in sys.modules and 'transformers' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
