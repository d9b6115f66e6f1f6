"""Measurements on real compiled programs: the layer above ``train/`` that builds Trainers to time them.

* :mod:`~jaxdist.measure.steps`: memory, collective bytes and step time of a config's compiled train step;
* :mod:`~jaxdist.measure.calibrate`: ``jaxdist calibrate`` (links, efficiency and overheads for the planner);
* :mod:`~jaxdist.measure.remat`: what XLA reports for a remat policy (checks and benchmarks).

The planner and the remat selector only *read* what is measured here; nothing below imports this package.
"""
