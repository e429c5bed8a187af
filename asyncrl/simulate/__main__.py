"""``python -m asyncrl.simulate``: the sizing tool (``cli.main``)."""

import sys

from asyncrl.simulate.cli import main

sys.exit(main())
