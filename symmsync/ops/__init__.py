"""The compiled calls: every ``torch.ops.symmsync`` op, and how an op names the object it calls.

Owns the one registration of an op (:mod:`.oplib`), the handles that name an object to a
graph (:mod:`.handles`) and the ops of the fence (:mod:`.fence`), the collectives
(:mod:`.collectives`) and the direct-KV writer (:mod:`.kv`). An op's body calls the object
its handle names, found by the kind it was registered with, so this package imports only
:mod:`symmsync.errors` and :mod:`symmsync.checks`: the core and the consumers import it, never
the other way round.
"""
