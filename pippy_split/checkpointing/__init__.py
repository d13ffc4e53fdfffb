"""The parts of :mod:`pippy_split.checkpoint` (import that one): key layout and errors
(``layout``), what a rank holds as keys (``keys``), safe writing (``files``), and DCP's
save protocol over numpy-free collectives (``comm``)."""
