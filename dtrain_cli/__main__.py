"""``python -m dtrain_cli ...``: the same as the ``dtrain`` console script."""

import sys

from dtrain_cli.main import main

sys.exit(main())
