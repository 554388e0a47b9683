"""Tools around the library: the install check (:mod:`.doctor`, ``python -m symmsync``) and a
stand-in for a runtime's cache allocator (:mod:`.runtime_alloc`). They may import anything of
symmsync; nothing of symmsync imports them.
"""
