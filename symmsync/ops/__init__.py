"""What every compiled call shares: how a torch op is registered, and how an op names its object.

Owns the one registration of an op (:mod:`.oplib`), the handles that name an object to a
graph (:mod:`.handles`, checked by class on lookup) and the fence's op (:mod:`.fence_op`,
which the core's :class:`~symmsync.Fence` serves by registration). Each consumer's ops live
beside it (:mod:`symmsync.collectives.torch_ops`, :mod:`symmsync.pcp.torch_ops`,
:mod:`symmsync.moe.torch_ops`) and call its public checked entry point. This package imports
only :mod:`symmsync.errors` and :mod:`symmsync.checks`: the core and the consumers import it,
never the other way round.
"""
