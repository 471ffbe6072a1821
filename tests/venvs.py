"""Virtual environments the real-client tests build once per cache directory: a client library
the project does not depend on (with pins of its own) runs from there, the project's environment
stays clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def client_venv(name: str, packages: list[str], *, system_site_packages: bool = False,
                no_deps: bool = False) -> Path:
    """The python of ``$ROLLOUT_ENGINE_CACHE/<name>`` with ``packages`` installed (rebuilt when
    the list changes)."""
    root = Path(os.environ.get("ROLLOUT_ENGINE_CACHE", Path.home() / ".cache" / "rollout_engine"))
    venv = root / name
    python = venv / "bin" / "python"
    stamp = venv / "installed.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == packages):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv),
                        *(["--system-site-packages"] if system_site_packages else [])],
                       check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q",
                        *(["--no-deps"] if no_deps else []), *packages],
                       check=True, timeout=900)
        stamp.write_text(json.dumps(packages))
    return python
