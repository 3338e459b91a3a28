"""``python -m megatron_ext <command>``: same as the ``megatron-ext`` console script."""

import sys

from megatron_ext.cli import main

sys.exit(main())
