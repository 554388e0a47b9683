"""symmsync.ops.handles: ints that name objects to the custom ops, held weakly, checked on lookup."""

import gc

import pytest

import symmsync as ss
from symmsync.ops import handles


class Thing:
    pass


class Other:
    pass


def test_a_handle_names_its_object():
    a, b = Thing(), Thing()
    ha, hb = handles.register(a), handles.register(b)
    assert ha != hb
    assert handles.lookup(ha, Thing) is a and handles.lookup(hb, Thing) is b


def test_a_handle_of_another_class_is_refused():
    h = handles.register(keep := Other())
    with pytest.raises(ss.ConfigError, match=f"handle {h} names a Other object, not a Thing"):
        handles.lookup(h, Thing)
    assert handles.lookup(h, Other) is keep


def test_a_number_never_issued_is_refused():
    with pytest.raises(ss.ConfigError, match="not a symmsync handle of this process"):
        handles.lookup(handles.register(Thing()) + 1000, Thing)


def test_a_handle_does_not_keep_its_object_alive():
    thing = Thing()
    h = handles.register(thing)
    del thing
    gc.collect()
    with pytest.raises(ss.ClosedError, match=f"handle {h} named a Thing that no longer exists"):
        handles.lookup(h, Thing)
