"""The tensor layer: where a tpu tensor's data lives, and what CPU checks about it.

``storage`` holds the jax array on the tensor's storage and reads and writes views of it;
``transfer`` moves data between the host and the device; ``meta`` runs torch's meta kernels on
stand-ins; ``overlap``, ``value_checks`` and ``out_dtypes`` are CPU's refusals; ``math_bits`` the
conjugate and negative views; ``storage_api``, ``legacy_storage`` and ``serialization`` the Python
storage API, ``torch.tpu.FloatStorage`` and kin, and ``repr``/pickling/``torch.save``.
It imports only ``core`` and ``runtime``.
"""
