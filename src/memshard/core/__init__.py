"""The core every layer stands on: the one user-facing error (``errors``), files read and
written safely (``files``), quantities parsed and printed (``quantities``), the graph IR
(``graph``), the device mesh (``mesh``) and placements with DTensor semantics (``placement``).
Nothing here knows of strategies, plans or searches."""
