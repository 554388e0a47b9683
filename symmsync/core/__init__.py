"""The core: symmetric memory and the objects that synchronize over it.

Owns the buffer (:mod:`.buffer`, :mod:`.memory`), its views and what a view does when it
fails (:mod:`.views`, :mod:`.failure`), the fences and signals (:mod:`.fence`,
:mod:`.signals`), the launch path of every kernel (:mod:`.launch`), how ranks agree on a
collective call (:mod:`.agreement`) and how a group splits into nodes (:mod:`.nodes`). It may
import :mod:`symmsync.errors`, :mod:`symmsync.checks`, :mod:`symmsync.backends`,
:mod:`symmsync.language` and :mod:`symmsync.ops`; never the node layer
(:mod:`symmsync.spanning`) or a consumer, which register with it where it must reach them.
"""
