"""Hugging Face checkpoints in and out: Llama 2/3, Mistral, Qwen2/3, Mixtral and Qwen3-MoE ``config.json`` + ``*.safetensors``.

``tensors`` (no JAX) names every Hugging Face tensor and its layout in jaxdist's parameter tree;
``safetensors_io`` (no JAX) reads slices of ``*.safetensors`` files and writes them;
``load`` reads a checkpoint straight into its sharded place on the mesh and ``export`` writes one back.
Elsewhere, by layer: ``jaxdist/config/hf.py`` (no JAX) maps a ``config.json`` to and from
:class:`~jaxdist.config.ModelConfig` (``model.init_from``); ``jaxdist/convert.py`` runs ``jaxdist convert``
(``jaxdist/convert_config.py``: its configs, no JAX).  This file imports nothing, so the JAX-free modules
stay JAX-free.
"""
