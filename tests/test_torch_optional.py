"""torch stays optional: ``import overlap`` never imports it, and ``overlap.torch`` without
torch fails with the fix in its message. Runs with or without torch installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          timeout=120)


def test_import_overlap_does_not_import_torch():
    out = _child(
        "import sys\n"
        "import overlap, overlap.runtime, overlap.pipeline, overlap.launch, overlap.cli\n"
        "from overlap.backends import make_backend\n"
        "print('torch' in sys.modules)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_overlap_torch_without_torch_names_the_fix():
    out = _child(
        "import builtins\n"
        "real = builtins.__import__\n"
        "def no_torch(name, *a, **k):\n"
        "    if name == 'torch' or name.startswith('torch.'): raise ImportError('no torch')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = no_torch\n"
        "import overlap\n"
        "try:\n"
        "    import overlap.torch\n"
        "except ImportError as e:\n"
        "    print('clear error:', e)\n"
    )
    assert out.returncode == 0, out.stderr
    assert "clear error:" in out.stdout and "pip install -e '.[torch]'" in out.stdout, out.stdout
