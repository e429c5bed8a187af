"""torchrun entry point: every rank runs this. See asyncrl/cluster/launcher.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from asyncrl.cluster.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
