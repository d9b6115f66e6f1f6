"""The sampler (``jaxdist sample``, :class:`jaxdist.sample.sampler.Sampler`): a run's checkpoint continues prompts.

``config.py`` (a run's config and the checks of a request, no JAX), ``load.py`` (a checkpoint's parameters onto a
mesh, read-only), ``decode.py`` (the jitted prefill and decoding-step programs, the key/value cache bookkeeping
and the token choice), ``sampler.py`` (:class:`Sampler`).

Nothing is imported here, so ``jaxdist.sample.config`` stays JAX-free for the command line (it runs before
XLA_FLAGS are set) and for the generation cluster's JAX-free modules.
"""
