"""The device layer: the ``torch.tpu`` module and what it offers beside the ops.

``tpu_module`` is registered as ``torch.tpu`` (``device_count``, ``synchronize``, seeds, memory
statistics); ``graphs`` and ``graphed_callables`` are capture and replay (``torch.tpu.graph``);
``streams`` the stream API; ``module_move`` keeps ``model.to("tpu")``'s Parameter objects.
"""
