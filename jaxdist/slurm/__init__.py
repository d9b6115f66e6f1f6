"""Slurm: what a partition's nodes hold (parsed from ``sinfo`` / ``scontrol``), the request shape a job asks
for, and a real Slurm cluster on one machine for tests and benchmarks.  No JAX.

* :mod:`jaxdist.slurm.parse`: pure parsers of ``scontrol show node -d``, ``scontrol show job -d`` and
  ``sinfo`` text, and Slurm's host list syntax (``n[1-3,7]``);
* :mod:`jaxdist.slurm.view`: a partition's free GPUs per node, read from the live cluster, and the
  cluster description that puts the cluster file's figures on them;
* :mod:`jaxdist.slurm.shape`: the (nodes, GPUs per node, which nodes) a job asks for, scored for the
  job and for the free GPUs it leaves;
* :mod:`jaxdist.slurm.local_cluster`: ``munged``, ``slurmctld`` and several ``slurmd`` on this host
  with fake GPUs.
"""
