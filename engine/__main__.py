"""``python -m engine``: the ``gadget-engine`` command line."""

from __future__ import annotations

from ._entry import main

raise SystemExit(main())
