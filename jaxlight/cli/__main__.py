"""``python -m jaxlight.cli``: the ``jaxlight`` console script."""

import sys

from jaxlight.cli.main import main

sys.exit(main())
