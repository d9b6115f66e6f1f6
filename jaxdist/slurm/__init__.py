"""Slurm: what a partition's nodes hold (parsed from ``sinfo`` / ``scontrol``) and the request shape a job asks
for.  No JAX.  (The real Slurm cluster on one machine that the tests and benchmarks run is test harness:
``tests/slurm/local_cluster.py``.)

* :mod:`jaxdist.slurm.parse`: pure parsers of ``scontrol show node -d``, ``scontrol show job -d`` and
  ``sinfo`` text, and Slurm's host list syntax (``n[1-3,7]``);
* :mod:`jaxdist.slurm.view`: a partition's free GPUs per node, read from the live cluster, and the
  cluster description that puts the cluster file's figures on them;
* :mod:`jaxdist.slurm.shape`: the (nodes, GPUs per node, which nodes) a job asks for, scored for the
  job and for the free GPUs it leaves.
"""
