"""``python -m llamaspec ...``: the same command line as the ``llamaspec`` console script."""
from __future__ import annotations

from .cli.main import main

if __name__ == "__main__":  # pragma: no cover
    main(prog_name="llamaspec")
