"""jaxdist: a JAX/XLA training framework for large models on device meshes."""

__version__ = "0.1.0"
