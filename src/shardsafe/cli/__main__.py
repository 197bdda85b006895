"""``python -m shardsafe.cli ...``: the same as the ``shardsafe`` command."""

import sys

from shardsafe.cli.main import main

sys.exit(main())
