"""The generation cluster: data-generation workers that feed a training run, and the decisions of its schedule.

The dispatcher and workers (``job.py``, ``worker.py``, ``tasks.py``, ``chain.py``), the CURVE channel
(``channel.py``), the training run's receiver (``delivery.py``), and the scheduling decisions (``runlog.py``,
``perfmodel.py``, ``profile.py``, ``schedule.py``, ``selection.py``, ``rounds.py``, ``job_plan.py``).  None of
them imports JAX; a worker whose function is ``"sampler"`` loads :mod:`jaxdist.sample` when it starts one.
"""
