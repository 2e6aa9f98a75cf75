"""A run's numbers and their drawing: `xffl report` and the figures `xffl status` shows.

Where each site's round went (``breakdown``), the per-site estimates of a round's time
(``estimates``), the report's rows (``numbers``), its plots and page (``render``, ``matrix``,
``summary``), written at once (``write``). Above the registry.
"""
