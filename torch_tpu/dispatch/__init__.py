"""The dispatch layer: the PrivateUse1 kernels PyTorch's dispatcher calls.

``op_kernel`` serves every lowered op from the lowering table (:mod:`torch_tpu.ops`), one plan per
input signature; ``hand_kernels`` the ops that are not functions of arrays (allocation, copies,
views, storage surgery); ``fallback`` an op without a lowering (decomposed, else run on the host,
counted). Three placement heuristics decide where an op runs: ``host_placement`` (small ops whose
shapes change at every call run on the host), ``view_reads`` (views of churning geometry are read
before the op) and ``runtime_ints`` (ints that change per call become runtime arguments).
``autocast``, ``sparse`` and ``nested`` serve their own dispatch keys.
"""
