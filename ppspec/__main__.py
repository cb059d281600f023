"""``python -m ppspec``: the ``ppspec`` command (``python -m ppspec serve ...``)."""
import sys

from ppspec.cli import main

sys.exit(main())
