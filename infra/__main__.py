"""What `pulumi up` runs (Pulumi.yaml: `main: infra/`).

Pulumi executes this directory as a script, so `infra/` - not the repository root - is first on
sys.path. The project is installed editable in .venv, which makes `import infra` work; the root is
put on sys.path as well so a checkout without the editable install still runs.
"""

import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from infra.program import run_stack  # noqa: E402

run_stack()
