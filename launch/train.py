"""torchrun entry point: every rank runs this. See asyncrl/runner/launcher.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from asyncrl.runner.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
