"""Views whose members span nodes: what crosses nodes, and who owns it.

No kernel can address another node's memory; what must cross goes through the job's
torch.distributed backend in a bounded, failure-aware exchange (:mod:`.exchange`), and a view
that spans nodes owns its node view and that one exchange (:mod:`.view`). It may import the
core and everything below it; the consumers' forms over nodes (``collectives.spanning``,
``pcp.routes``) import it. It registers with :mod:`symmsync.core.failure` so that an abort of a
spanning view reaches the other nodes.
"""
