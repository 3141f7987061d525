"""The bottom layer: facts every other layer asks, with no import of the package.

``dtypes`` (torch <-> jax dtypes), ``compat`` (what differs between the supported torch and jax
versions), ``devices`` (which XLA device ``tpu:N`` names), ``rng`` (the device's random state) and
``extension`` (loading the optional C++ extension). Nothing here imports another layer.
"""
