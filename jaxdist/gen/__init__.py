"""Generation: the sampler (``jaxdist sample``) and the data-generation workers that feed a training run.

Sampler modules: ``sample_config.py`` (a run's config and the checks of a
request, no JAX), ``sample_load.py`` (a checkpoint's parameters onto a mesh),
``decode.py`` (the jitted prefill and decoding-step programs, the key/value
cache bookkeeping and the token choice), ``sampler.py`` (:class:`Sampler`).

Nothing is imported here, so ``jaxdist.gen.sample_config`` stays JAX-free for
the command line (it runs before XLA_FLAGS are set).
"""
